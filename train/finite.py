"""No non-finite checkpoint: the loss of every step is watched on the device, and the state is
checked before each checkpoint is written (and the loss at each log step), so a run that diverges
stops with one line and keeps its last good `last.pt`.
"""
import torch

from . import dist
from laplace.errors import UserError

NEVER = 2**62  # "no non-finite step yet": larger than any step


class Diverged(UserError, FloatingPointError):
    """The training loss or the state to be saved is not finite: one line, the run stops."""


class FiniteGuard:
    """The first step whose loss was not finite, on any rank.

    Args:
        device: where the losses live.
        run_dir: named in the error (the command that continues from the last good step).
        good_step: the step of the newest checkpoint (a resumed run's), None for a fresh run.
    """

    def __init__(self, device: torch.device, run_dir, good_step: int | None):
        # Why watch every step: a loss that turned NaN between two log steps used to reach the next
        # checkpoint step unnoticed and overwrite the good last.pt with NaN weights, which every
        # resume then continued from. Watching costs no host sync: `update` folds each step's loss
        # into these device tensors; `check` reads them (one sync, all ranks agreeing) only where
        # the loop syncs anyway (a log step, a checkpoint).
        self.first = torch.full((), NEVER, dtype=torch.int64, device=device)
        self.value = torch.zeros((), device=device)
        self.run_dir, self.good_step = run_dir, good_step

    def update(self, step: int, loss: torch.Tensor):
        """Record `loss` (the step's, detached) if it is the first non-finite one. Device ops only."""
        new = ~torch.isfinite(loss) & (self.first == NEVER)
        self.first = torch.where(new, step, self.first)
        self.value = torch.where(new, loss.float(), self.value)

    def check(self, step: int, model: torch.nn.Module | None = None):
        """Raise Diverged if a loss so far, or (before a checkpoint) a tensor of `model`, is not
        finite on any rank; every rank calls it at the same step. Then `step` is a good one."""
        # One collective for both: the first bad step and minus the number of bad tensors.
        bad = [] if model is None else [t for t in model.state_dict().values() if t.is_floating_point()]
        n_bad = torch.zeros((), dtype=torch.int64, device=self.first.device)
        if bad:
            n_bad = (~torch.stack([torch.isfinite(t).all() for t in bad])).sum().to(n_bad.device)
        first, minus_bad = dist.all_reduce_min(torch.stack([self.first, -n_bad])).tolist()
        if first != NEVER:
            value = float(self.value) if int(self.first) == first else float("nan")
            self._fail(f"the training loss is {value} at step {first}", first)
        if minus_bad:
            names = [n for n, t in model.state_dict().items() if t.is_floating_point() and not torch.isfinite(t).all()]
            self._fail(f"after step {step}, {-minus_bad} tensor(s) of the model hold NaN or inf "
                       f"({', '.join(names[:3]) or 'on another rank'}) while the loss was finite", step)
        if model is not None:
            self.good_step = step

    def _fail(self, what: str, step: int):
        kept = (f"last.pt keeps step {self.good_step}, the last finite state" if self.good_step is not None
                else "no checkpoint was written")
        resume = (f"; to continue from step {self.good_step} with the new setting, add run_dir={self.run_dir} "
                  f"trainer.resume=force" if self.good_step is not None else "")
        raise Diverged(f"training diverged: {what} ({kept}); lower optim.lr or set optim.grad_clip{resume}")
