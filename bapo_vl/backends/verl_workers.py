"""The verl worker a bapo-vl run starts for its actor (and reference): verl's DetachActorWorker (save/restore of
the model to CPU, for the stale-alpha snapshot), with bapo-vl's chunked log-probs in its own process only, and a
vision tower that attends to its images and windows in a few batched calls (bapo_vl/vision_attention.py) where
transformers would loop over them: verl runs the tower through transformers, and without flash-attn (verl's actor
then runs with sdpa) that is one attention call per image or window, in each block, forward and backward."""
from verl.experimental.separation.engine_workers import DetachActorWorker
from verl.single_controller.base.decorator import Dispatch, register

from bapo_vl.backends.verl_loss import use_chunked_logprobs
from bapo_vl.vision_attention import use_segment_attention


class ActorWorker(DetachActorWorker):
    def __init__(self, *args, **kwargs):
        use_chunked_logprobs()
        super().__init__(*args, **kwargs)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self):
        super().init_model()
        for trained in (self.actor, self.ref):  # the reference exists only with a KL term
            if trained is not None:
                use_segment_attention(trained.engine.module)
