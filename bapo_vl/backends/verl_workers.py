"""The verl worker a bapo-vl run starts for its actor (and reference): verl's DetachActorWorker (save/restore of
the model to CPU, for the stale-alpha snapshot), with bapo-vl's chunked log-probs in its own process only."""
from verl.experimental.separation.engine_workers import DetachActorWorker

from bapo_vl.backends.verl_loss import use_chunked_logprobs


class ActorWorker(DetachActorWorker):
    def __init__(self, *args, **kwargs):
        use_chunked_logprobs()
        super().__init__(*args, **kwargs)
