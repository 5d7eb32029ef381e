"""A program's learning-rate schedule, honoured by every runtime (stage: runtime).

A static program built with ``paddle.optimizer.SGD(paddle.optimizer.lr.StepDecay(...))`` reads its
learning rate from a variable (``program.lr_name``); Paddle's ``Executor.run`` writes
``program.lr_scheduler()`` into it before every run (paddle/base/executor.py), and the user
calls ``scheduler.step()`` between steps. autopar's runtimes run clones of the program, which
Paddle's executor never sees as the scheduled program, so without this every step trained at
the initial rate — silently.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class LearningRateSchedule:
    scheduler: Any  # the user's paddle.optimizer.lr.LRScheduler: stepped by the user, read here
    name: str  # the scope variable the updates read the rate from

    @classmethod
    def of(cls, program: Any) -> LearningRateSchedule | None:
        """The schedule ``program`` was built with, or None (a constant learning rate)."""
        scheduler = getattr(program, "lr_scheduler", None)
        return None if scheduler is None else cls(scheduler, str(program.lr_name))

    def write(self, scope: Any, place: Any) -> None:
        """Put the scheduler's current rate into ``scope`` (if this rank holds the variable:
        a pipeline stage that runs no update may not)."""
        var = scope.find_var(self.name)
        if var is None:
            return
        tensor = var.get_tensor()
        if not tensor._is_initialized():
            return
        rate = np.full(tuple(tensor.shape()), self.scheduler(), dtype=np.array(tensor).dtype)
        tensor.set(rate, place)
