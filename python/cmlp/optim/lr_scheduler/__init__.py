"""cmlp.optim.lr_scheduler: torch.optim.lr_scheduler's schedules, with torch's names, defaults,
formulas (the same recursive forms, so the rates are torch's to the last bit; the exceptions are
rates torch goes below 0 with, which the optimizer here refuses: one step past its end
OneCycleLR's linear strategy gives torch a negative rate (never trained with) and a momentum past
its range, here 0 and the range's end; CosineAnnealingLR's recursive form takes a rate below its
eta_min > 0 (a group at rate 0, or one a chained StepLR took there) below 0 in torch, to 0 here,
and the rates it makes from it later differ from torch's, in the last bits for a group at 0 and
more for a chain) and state_dict, over a cmlp optimizer's learning rates. A gamma, eta_min,
power or max_lr that is negative or not finite, which torch takes, is refused.

    opt = cmlp.optim.Adam(model.parameters(), lr=1e-3)
    sched = cmlp.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=5)
    for epoch in range(5):
        trainer.fit(x, y, epochs=1)      # or: Trainer.fit(..., epochs=5, scheduler=sched)
        sched.step()

A schedule sets the rate of every param group (`optimizer.param_groups[i]["lr"]`, each from the
group's own 'initial_lr', as in torch; `optimizer.lr` is the first group's). OneCycleLR and
CyclicLR also move each group's momentum (Adam's beta1, SGD's momentum), between momenta given
once for all groups or one per group. `Trainer.fit(..., scheduler=sched)` steps a schedule after each
epoch, or with `scheduler_interval="step"` after each optimizer step (warm-up):

    sched = cmlp.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / 500))
    trainer.fit(x, y, epochs=5, scheduler=sched, scheduler_interval="step")

Off the CPU a step reads its rates (and momentum, which OneCycleLR and CyclicLR move) on the device, so a step
captured as a CUDA graph replays at every rate.
"""
from ._base import LRScheduler
from ._composite import ChainedScheduler, SequentialLR
from ._cyclic import CyclicLR, OneCycleLR
from ._plateau import ReduceLROnPlateau
from ._simple import (ConstantLR, CosineAnnealingLR, CosineAnnealingWarmRestarts, ExponentialLR, LambdaLR, LinearLR,
                      MultiplicativeLR, MultiStepLR, PolynomialLR, StepLR)

__all__ = ["LRScheduler", "LambdaLR", "MultiplicativeLR", "StepLR", "MultiStepLR", "ConstantLR", "LinearLR",
           "ExponentialLR", "PolynomialLR", "CosineAnnealingLR", "CosineAnnealingWarmRestarts", "OneCycleLR",
           "CyclicLR", "SequentialLR", "ChainedScheduler", "ReduceLROnPlateau"]

# reprs and pickles name them here, where torch keeps them and where earlier versions defined them
for _public in (LRScheduler, LambdaLR, MultiplicativeLR, StepLR, MultiStepLR, ConstantLR, LinearLR, ExponentialLR,
                PolynomialLR, CosineAnnealingLR, CosineAnnealingWarmRestarts, OneCycleLR, CyclicLR, SequentialLR,
                ChainedScheduler, ReduceLROnPlateau):
    _public.__module__ = __name__
del _public

_LRScheduler = LRScheduler  # torch's older name, still exported
