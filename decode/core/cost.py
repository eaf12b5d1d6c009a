"""What a position costs: the device's verification cost curve c(n), learnt from the rounds themselves.

c(n) = seconds of one target forward that scores n positions ÷ seconds of a one-token forward, at about the
same context length. It is not a constant of the machine: on this CPU 3 positions cost 1.25 steps on one
prompt set and more than 5 on another (issue 21), so the curve is kept per context bucket (``bucket``
tokens wide) and every round adds a measurement (``SpecEngine.step`` reports its forward's time).

Honest under noise: each (n, bucket) keeps its last ``window`` forward times and answers with their
median (one slow round cannot move it), and c(n) divides by the median one-token time of the same bucket
and window, so a machine slowed down as a whole changes both and leaves the ratio alone. A size never
measured in a bucket borrows the nearest bucket's ratio; a size never measured anywhere is interpolated
linearly between measured sizes (and extrapolated with the last slope), never guessed as 1.

``probe`` seeds the curve before the first round (a few forwards per size, rolled back).
"""
from __future__ import annotations

import statistics
from collections import deque

import torch

CONTEXT_BUCKET = 256
WINDOW = 32


class CostCurve:
    def __init__(self, bucket: int = CONTEXT_BUCKET, window: int = WINDOW):
        if bucket < 1 or window < 1:
            raise ValueError(f"bucket and window must be >= 1, got {bucket}, {window}")
        self.bucket, self.window = int(bucket), int(window)
        self._times: dict[tuple[int, int], deque] = {}
        # the context buckets and sizes measured (every deque holds one time at least): asked every round
        self._buckets: set[int] = set()
        self._sizes: set[int] = set()
        # bucket -> {n: median seconds}, until the bucket is measured again (controllers ask many n every round)
        self._median_memo: dict[int, dict[int, float]] = {}

    def _key(self, n: int, context: int) -> tuple[int, int]:
        return int(n), int(context) // self.bucket

    def observe(self, n: int, context: int, seconds: float) -> None:
        """One forward of ``n`` positions after ``context`` tokens took ``seconds``."""
        if n < 1 or not seconds > 0:
            return
        key = self._key(n, context)
        times = self._times.get(key)
        if times is None:
            times = self._times[key] = deque(maxlen=self.window)
            self._sizes.add(key[0])
            self._buckets.add(key[1])
        times.append(float(seconds))
        self._median_memo.pop(key[1], None)

    def seconds(self, n: int, context: int) -> float | None:
        """Median measured seconds of an ``n``-position forward in ``context``'s bucket (None: none yet)."""
        times = self._times.get(self._key(n, context))
        return statistics.median(times) if times else None

    def _bucket_times(self, b: int) -> dict[int, float]:
        """{n: median seconds} measured in bucket ``b`` (memoised: a controller asks for many n every round, the
        curve changes once per round)."""
        if b not in self._median_memo:
            self._median_memo[b] = {n: statistics.median(t) for (n, bb), t in self._times.items() if bb == b and t}
        return self._median_memo[b]

    def _ratios(self, b: int) -> dict[int, float]:
        """{n: c(n)} measured in bucket ``b``: its medians over its one-token forward's."""
        times = self._bucket_times(b)
        base = times.get(1)
        return {} if base is None else {n: t / base for n, t in times.items()}

    def steps(self, n: int, context: int) -> float:
        """c(n): an ``n``-position forward in one-token steps, near ``context`` tokens of context (1.0 for n = 1;
        n ≥ 2 from measurements as the module docstring says; n/1 linear when nothing at all is measured)."""
        n = int(n)
        if n <= 1:
            return 1.0
        b = int(context) // self.bucket
        buckets = sorted(self._buckets, key=lambda bb: (abs(bb - b), bb))
        for bb in buckets:  # this bucket, then the nearest ones
            r = self._ratios(bb)
            if n in r:
                return r[n]
        merged: dict[int, float] = {}
        for bb in reversed(buckets):  # nearer buckets overwrite farther ones
            merged.update(self._ratios(bb))
        merged[1] = 1.0
        if len(merged) == 1:
            return float(n)
        return _interpolate(merged, n, floor=1.0)

    def seconds_at(self, n: int, context: int) -> float | None:
        """Median seconds of an ``n``-position forward near ``context`` in absolute terms (what batched rounds use,
        where n = rows × block width and a one-position forward is never run): measured in the nearest bucket with
        any measurement, interpolated linearly between the sizes measured there. Below the smallest size ``s``
        measured there, another bucket that measured both ``s`` and sizes down to ``n`` (the nearest such) lends its
        ratio t(n) / t(s); without one, the smallest size's time (a smaller forward costs no more). Reading t(s)
        itself made a batch of 10 rows cost what 14 did in a bucket its rounds reached only with 14 rows or with
        blocks two positions wide (which were then never measured against a plain round of 10: c_10(3) read 1.3
        where forwards gave 1.5). Beyond the largest size ``m`` measured there, another bucket that measured
        both ``m`` and sizes up to ``n`` (the nearest such) lends its growth t(n) / t(m); only without one is the
        last slope continued (or n/m when one size is known). A batch's rounds measure a cluster of nearby sizes in
        each new context bucket (B, B - 1, … rows of one position), whose last slope is noise: continued to 2B it
        made a block of two positions look nearly free. None when nothing is measured."""
        n, b = int(n), int(context) // self.bucket
        buckets = sorted(self._buckets, key=lambda bb: (abs(bb - b), bb))
        if not buckets:
            return None
        times = self._bucket_times(buckets[0])
        if n in times:
            return times[n]
        smallest, largest = min(times), max(times)
        if n < smallest:
            for bb in buckets[1:]:
                other = self._bucket_times(bb)
                if smallest in other and min(other) <= n and len(other) >= 2:
                    return times[smallest] * _interpolate(other, n, floor=other[min(other)]) / other[smallest]
            return times[smallest]
        if n > largest:
            for bb in buckets[1:]:
                other = self._bucket_times(bb)
                if largest in other and max(other) >= n and len(other) >= 2:
                    return times[largest] * _interpolate(other, n, floor=other[largest]) / other[largest]
        if len(times) == 1:
            return times[smallest] * n / smallest
        return _interpolate(times, n, floor=times[smallest])

    def growth(self, n: int, m: int, context: int) -> float | None:
        """t(m) / t(n) read inside one context bucket, the nearest to ``context`` whose measured sizes span both
        (linear between them there, never beyond): what a batch's block of m positions costs against its plain
        round of n. None when no bucket spans both. A ratio from one bucket, not two absolute times each read from
        the nearest bucket that has anything: a batch reaching a new context bucket measures only what it plays
        there (blocks of 10 rows × 2 positions, say), and t(10) read from that bucket's t(20) made a block of two
        positions look free."""
        n, m, b = int(n), int(m), int(context) // self.bucket
        for bb in sorted(self._buckets, key=lambda x: (abs(x - b), x)):
            times = self._bucket_times(bb)
            lo, hi = min(times), max(times)
            if lo <= min(n, m) and max(n, m) <= hi:
                at = {k: times[k] if k in times else _interpolate(times, k, floor=0.0) for k in (n, m)}
                return at[m] / at[n] if at[n] > 0 else None
        return None

    def table(self) -> dict[str, dict[str, float]]:
        """{bucket start: {n: c(n)}} of every measured size, for reports."""
        out: dict[str, dict[str, float]] = {}
        for b in sorted(self._buckets):
            r = self._ratios(b)
            if r:
                out[str(b * self.bucket)] = {str(n): round(v, 3) for n, v in sorted(r.items())}
        return out

    def sizes(self) -> set[int]:
        """Every n measured, in any context bucket."""
        return set(self._sizes)

    def samples(self) -> int:
        return sum(len(t) for t in self._times.values())

    @classmethod
    def from_forwards(cls, forwards, bucket: int = CONTEXT_BUCKET) -> "CostCurve":
        """A curve of every ``(n, context, seconds)`` measurement given (no window: a report's whole run)."""
        forwards = list(forwards)
        curve = cls(bucket=bucket, window=max(len(forwards), 1))
        for n, context, seconds in forwards:
            curve.observe(n, context, seconds)
        return curve


class DraftCost:
    """What one drafted token costs each arm, in one-token steps (a round's draft seconds ÷ its drafted tokens ÷ its
    step seconds): the median of the arm's last ``window`` drafting rounds, so one round's one-off work cannot move
    it, as one slow forward cannot move the curve. The first round of a query carries an EAGLE head's catch-up over
    the prompt (0.15-0.26 steps a token against 0.06-0.09 after it on the AMD EPYC): a running mean kept it in the
    figure for the whole query."""

    def __init__(self, window: int = WINDOW):
        self._per_token: dict[int, deque] = {}
        self._median: dict[int, float] = {}  # taken once a round, when it changes (plans read it many times)
        self.window = int(window)

    def observe(self, record) -> None:
        """A played round's :class:`~decode.core.draft.RoundRecord` (rounds that drafted nothing say nothing)."""
        if record.drafted > 0 and record.step_time > 0:
            times = self._per_token.setdefault(record.arm, deque(maxlen=self.window))
            times.append(record.draft_time / record.drafted / record.step_time)
            self._median[record.arm] = statistics.median(times)

    def __getitem__(self, arm: int) -> float:
        """The arm's cost of a drafted token in steps (0 until it has drafted)."""
        return self._median.get(arm, 0.0)


def verification_forwards(prompt_len: int, rounds, step_times) -> list[list]:
    """One generation's verification forwards as ``[n positions, context tokens, ms]`` per round (what a
    report rebuilds the curve from): n = drafted + 1, context = the prompt plus the tokens before the round."""
    out, context = [], int(prompt_len)
    for r, t in zip(rounds, step_times):
        out.append([r.drafted + 1, context, round(1000 * t.score, 3)])
        context += r.new_tokens
    return out


def curve_summary(forwards) -> dict | None:
    """The report's ``cost_curve``: c(n) per context bucket (one-token steps, medians over the whole run)
    from ``[n, context, ms]`` forwards; None when no one-token forward was measured (no unit)."""
    curve = CostCurve.from_forwards((n, c, ms / 1000) for n, c, ms in forwards)
    table = curve.table()
    if not table:
        return None
    ms_one = {b: round(1000 * curve.seconds(1, int(b)), 2) for b in table}
    return {"bucket_tokens": curve.bucket, "steps": table, "one_token_ms": ms_one, "forwards": curve.samples()}


def markdown_curve(summary: dict) -> str:
    """The cost curve as a table: one row per context bucket, one column per measured n."""
    sizes = sorted({int(n) for row in summary["steps"].values() for n in row})
    head = "| context tokens | 1-token ms | " + " | ".join(f"c({n})" for n in sizes) + " |"
    rows = [head, "|" + "---|" * (len(sizes) + 2)]
    w = summary["bucket_tokens"]
    for b, row in summary["steps"].items():
        cells = [f"{row[str(n)]:.2f}" if str(n) in row else "—" for n in sizes]
        rows.append(f"| {b}–{int(b) + w - 1} | {summary['one_token_ms'][b]:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _interpolate(values: dict[int, float], n: int, floor: float) -> float:
    """``values`` (≥ 2 sizes) at ``n``: linear between the measured sizes around it, the last slope continued beyond
    the largest, never below ``floor``."""
    sizes = sorted(values)
    lo = max((s for s in sizes if s < n), default=sizes[0])
    hi = min((s for s in sizes if s > n), default=None)
    if hi is None:  # beyond the largest measured size: continue the last slope
        lo, hi = sizes[-2], sizes[-1]
    slope = (values[hi] - values[lo]) / (hi - lo)
    return max(values[lo] + slope * (n - lo), floor)


def probe(curve: CostCurve, target, prompt_ids: list[int], sizes, repeats: int = 3, clock=None) -> None:
    """Seed ``curve`` with ``repeats`` forwards of every size in ``sizes`` after ``prompt_ids`` (one warm-up
    forward per size first); the target's cache is rolled back after each, so nothing changes. ``clock``:
    a function returning seconds once the device is idle (the engine's)."""
    import time
    clock = clock or time.perf_counter
    target.prefill(prompt_ids)
    keep, last = len(prompt_ids) - 1, prompt_ids[-1]
    for n in sorted({int(s) for s in sizes if int(s) >= 1}):
        draft = torch.zeros(n - 1, dtype=torch.long)
        for k in range(repeats + 1):
            t0 = clock()
            target.score(last, draft)
            if k:
                curve.observe(n, len(prompt_ids), clock() - t0)
            target.rollback(keep)
