"""Save a randomly initialised Qwen2.5-VL-shaped model (byte tokenizer, the 3B model's head dimension of 128) for
GPU runs: python scripts/gpu/make_vl_model.py OUT_DIR [--hidden 1024 --heads 8 --kv-heads 2 --layers 4]"""
import argparse

from bapo_vl.tiny import build_qwen2_5_vl

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("--hidden", type=int, default=1024)
ap.add_argument("--heads", type=int, default=8)
ap.add_argument("--kv-heads", type=int, default=2)
ap.add_argument("--layers", type=int, default=4)
ap.add_argument("--intermediate", type=int, default=2816)
ap.add_argument("--max-pixels", type=int, default=448 * 448)
args = ap.parse_args()
model, processor = build_qwen2_5_vl(hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads, layers=args.layers,
                                    intermediate=args.intermediate, max_pixels=args.max_pixels)
model.save_pretrained(args.out)
processor.save_pretrained(args.out)
print(f"saved {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters to {args.out}")
