"""What the user sees while a run goes: a table redrawn on a terminal (LiveView, under rich's Live), or whole lines
for pipes and files (LineView). Both draw the progress events (agent/events.py): per shape the candidates tried,
failures by kind, the best time and its ratio to cuBLAS, why a shape got fewer candidates than asked; the run's
elapsed time, time left and ETA; and notices (an LLM call that failed, profiles switched off) when they happen."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from rich.table import Table

from agent.events import (
    BucketEndTimed,
    CandidateDone,
    Event,
    Notice,
    Profiling,
    RunStarted,
    ShapeCut,
    ShapeDone,
    ShapeStarted,
)
from core.records import Status


def fmt_us(t: float | None) -> str:
    return "-" if t is None or t != t or t == float("inf") else f"{t:,.2f}"


def fmt_ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}x"


def fmt_clock(seconds: float) -> str:
    """m:ss, or h:mm:ss from an hour on."""
    s = max(0, round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


@dataclass
class _Row:
    tried: int = 0
    fail: Counter = field(default_factory=Counter)
    best: float | None = None
    cublas: float | None = None
    ratio: float | None = None
    note: str = ""


class LiveView:
    """The run's progress as a table (rich renderable); `say` prints a line above it."""

    def __init__(self, title: str, console, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time):
        self.title, self.console, self.clock, self.wall = title, console, clock, wall
        self.rows: dict[str, _Row] = {}
        self.last = ""
        self.started: float | None = None
        self.budget_s = 0.0
        self.shapes = self.done = 0

    def __call__(self, event: Event) -> None:
        match event:
            case RunStarted():
                self.started, self.budget_s, self.shapes = event.started, event.budget_s, event.shapes
            case ShapeStarted():
                self._row(event.problem.key).tried = event.resumed
            case CandidateDone(problem=p, candidate=c, result=r):
                row = self._row(p.key)
                row.tried += 1
                if r.status not in (Status.OK, Status.SKIPPED):
                    row.fail[r.status.value] += 1
                if r.status is Status.OK and (row.best is None or r.time_us < row.best):
                    row.best, row.ratio, row.cublas = r.time_us, r.speedup, r.ranked[1].median_us
                self.last = f"{c.id} {c.family} {r.status.value} {r.reason[:80]}"
            case Profiling(candidate=c):
                self.last = f"{c.id}: profiling with Nsight Compute"
            case BucketEndTimed(candidate=c, m=m, result=r):
                said = f"{r.status.value} {fmt_ratio(r.speedup)} {r.reason[:80]}"
                self.last = f"{c.id} at the bucket's probe M={m}: {said}".rstrip()
            case ShapeCut(problem=p, got=got, asked=asked, why=why):
                self._row(p.key).note = f"{got} of {asked}: {why}"
                self.say(f"{p.key}: {got} of {asked} candidates: {why}")
            case ShapeDone():
                self.done += 1
            case Notice(problem=p, message=message):
                self.say(f"{p.key}: {message}" if p else message)

    def _row(self, key: str) -> _Row:
        return self.rows.setdefault(key, _Row())

    def say(self, line: str) -> None:
        self.console.print(line, soft_wrap=True, markup=False, highlight=False)

    def progress(self) -> str:
        """Elapsed, left of the budget, shapes done and when the run should end (by the pace of the shapes done,
        never later than the budget)."""
        if self.started is None:
            return ""
        elapsed = self.clock() - self.started
        left = max(self.budget_s - elapsed, 0.0)
        eta = min(left, elapsed / self.done * (self.shapes - self.done)) if self.done else left
        end = time.strftime("%H:%M:%S", time.localtime(self.wall() + eta))
        return (f"elapsed {fmt_clock(elapsed)}, left {fmt_clock(left)} of {fmt_clock(self.budget_s)}; "
                f"{self.done} of {self.shapes} shapes done; ETA {end}")

    def __rich__(self) -> Table:
        caption = "\n".join(line for line in (self.last, self.progress()) if line)
        t = Table(title=self.title, caption=caption or None)
        for col in ("shape", "tried", "failures", "best µs", "cuBLAS µs", "ratio", "note"):
            t.add_column(col)
        for key, r in self.rows.items():
            fails = ", ".join(f"{k} {v}" for k, v in sorted(r.fail.items())) or "-"
            t.add_row(key, str(r.tried), fails, fmt_us(r.best), fmt_us(r.cublas), fmt_ratio(r.ratio), r.note)
        return t


class LineView(LiveView):
    """The same progress as whole lines, one a candidate and one a shape done, for pipes and files."""

    def __init__(self, title: str, console, **clocks):
        super().__init__(title, console, **clocks)
        self.say(title)

    def __call__(self, event: Event) -> None:
        super().__call__(event)
        if isinstance(event, CandidateDone | Profiling | BucketEndTimed):
            self.say(f"{event.problem.key}: {self.last}")
        elif isinstance(event, ShapeDone):
            self.say(f"{event.problem.key} done ({event.tried} candidates); {self.progress()}")


@contextmanager
def progress_view(console, title: str) -> Iterator[LiveView]:
    """A table redrawn in place where the console is a terminal, whole lines elsewhere."""
    if not console.is_terminal:
        yield LineView(title, console)
        return
    from rich.live import Live

    view = LiveView(title, console)
    with Live(view, console=console, refresh_per_second=4, transient=False):
        yield view
