"""Differential profiles: BASE and NEW compared stack by stack, by name, as shares of their own totals.

Owns: pairing BASE's and NEW's graphs (by profile type and service, report/profiles.py's groups);
each side's value of every stack path; the movers table: per function, its self and total share in
BASE and in NEW, biggest change first. Shares are of each side's own total, so recordings of
different lengths or rates compare. Frames are matched by the names the report draws
(profiles.frame_name: the function, and module+offset only for a frame without a symbol), never by
address, so a diff across a deploy matches what kept its name. A service on one side only is paired
with an empty graph (every frame of it grown from, or shrunk to, nothing); a profile type with one
service on each side pairs them whatever their names (a deploy may move the executable).

Must not: read or write files (report/profiles.py does), or draw: the page, its colours and its byte
cap are report/html.py's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from report import profiles
from report.profiles import ALL_SERVICES, Group, Loaded

# Functions kept in a graph's movers table: more than a screen of rows tells nobody more.
MAX_MOVERS = 40
# A change in share below this is noise to the table (one sample in 100,000).
MIN_MOVER_SHARE = 1e-5


@dataclass(frozen=True)
class Mover:
    """One function's share of its side's total, self (as the leaf) and total (anywhere in the stack)."""

    function: str
    base_self: float
    new_self: float
    base_total: float
    new_total: float

    @property
    def self_delta(self) -> float:
        return self.new_self - self.base_self

    @property
    def total_delta(self) -> float:
        return self.new_total - self.base_total

    @property
    def status(self) -> str:
        """By the total share: "new" (not in BASE), "gone" (not in NEW), "grown", "shrunk" or "same"."""
        if not self.base_total:
            return "new"
        if not self.new_total:
            return "gone"
        return "grown" if self.total_delta > 0 else "shrunk" if self.total_delta < 0 else "same"


@dataclass(frozen=True)
class Pair:
    """One graph of the diff: NEW's and BASE's stacks of one profile type and service."""

    base: Group
    new: Group
    movers: tuple[Mover, ...]

    @property
    def profile_type(self) -> str:
        return self.new.profile_type

    @property
    def service(self) -> str:
        """NEW's name for it, with BASE's when they differ (`/opt/v1/app → /opt/v2/app`)."""
        if self.base.service == self.new.service or not self.base.stacks:
            return self.new.service
        if not self.new.stacks:
            return self.base.service
        return f"{self.base.service} → {self.new.service}"


def share(value: int, total: int) -> float:
    return value / total if total else 0.0


def movers(base: dict[tuple[str, ...], int], new: dict[tuple[str, ...], int]) -> tuple[Mover, ...]:
    """The functions whose share moved most (the larger of the self and the total change), at most MAX_MOVERS."""
    b_self, b_total, b_grand = profiles.function_values(base)
    n_self, n_total, n_grand = profiles.function_values(new)
    rows = [
        Mover(
            f,
            share(b_self[f], b_grand),
            share(n_self[f], n_grand),
            share(b_total[f], b_grand),
            share(n_total[f], n_grand),
        )
        for f in b_total.keys() | n_total.keys()
    ]
    rows = [m for m in rows if max(abs(m.self_delta), abs(m.total_delta)) >= MIN_MOVER_SHARE]
    rows.sort(key=lambda m: (-max(abs(m.self_delta), abs(m.total_delta)), m.function))
    return tuple(rows[:MAX_MOVERS])


def _empty(like: Group) -> Group:
    return Group(like.profile_type, like.service, like.unit, {}, 0)


def _pairs_of_type(base: list[Group], new: list[Group]) -> list[tuple[Group, Group]]:
    """Per service (one service each side: those two); a service on one side only against an empty graph."""
    if len(base) == 1 and len(new) == 1:
        return [(base[0], new[0])]
    b = {g.service: g for g in base}
    n = {g.service: g for g in new}
    return [(b.get(s) or _empty(n[s]), n.get(s) or _empty(b[s])) for s in sorted(b.keys() | n.keys())]


def _all_services(pairs: list[tuple[Group, Group]]) -> tuple[Group, Group]:
    """The graph of every service together, each the first frame of its stacks (NEW's name for it)."""
    ptype, unit = pairs[0][1].profile_type, pairs[0][1].unit
    sides = []
    for i in (0, 1):
        merged = {(p[1].service, *stack): v for p in pairs for stack, v in p[i].stacks.items()}
        sides.append(Group(ptype, ALL_SERVICES, unit, merged, sum(p[i].samples for p in pairs)))
    return sides[0], sides[1]


def compare(base: Sequence[Loaded], new: Sequence[Loaded]) -> list[Pair]:
    """The diff's graphs: per profile type on either side (cpu first), every service together when there
    are several, then each service."""
    b_groups = [g for g in profiles.groups(base) if g.service != ALL_SERVICES]
    n_groups = [g for g in profiles.groups(new) if g.service != ALL_SERVICES]
    types = list(dict.fromkeys(g.profile_type for g in n_groups + b_groups))
    types.sort(key=lambda t: (t != "cpu", t))
    out = []
    for ptype in types:
        pairs = _pairs_of_type(
            [g for g in b_groups if g.profile_type == ptype], [g for g in n_groups if g.profile_type == ptype]
        )
        if len(pairs) > 1:
            pairs.insert(0, _all_services(pairs))
        out += [Pair(b, n, movers(b.stacks, n.stacks)) for b, n in pairs]
    return out
