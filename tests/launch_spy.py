"""LaunchSpy(kernel): wraps a Triton kernel to record the arguments of every launch (the row-op
tests check the block sizes and grids the launchers pick). ``spy.launches``: (args, kwargs) per
launch, in order."""

from __future__ import annotations


class LaunchSpy:
    """Wraps a Triton kernel to record the keyword arguments of every launch."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.launches.append((args, kwargs))
            return launch(*args, **kwargs)

        return run
