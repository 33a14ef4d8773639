"""Progress through a stage's countable work: a bar on a terminal (tqdm), and in a log (stdout not
a terminal: CI, a sweep's job log) a line at each quarter, so a log is not flooded with redraws."""

import sys


class Progress:
    def __init__(self, total: int, what: str, unit: str):
        self.total, self.what, self.unit, self.done, self._said = max(total, 1), what, unit, 0, 0
        self._bar = None
        if sys.stdout.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=self.total, desc=f"  {what}", unit=f" {unit}", file=sys.stdout, leave=False,
                             dynamic_ncols=True)

    def update(self, n: int) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
            return
        quarter = min(4, 4 * self.done // self.total)
        if quarter > self._said:
            self._said = quarter
            print(f"  {self.what}: {25 * quarter}% ({min(self.done, self.total)}/{self.total} {self.unit})", flush=True)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.close()
