"""Forming a generation: step 4 of the failure path (step.py), and a restarted rank's way back in.

`Formation.form(g, candidates, step)` agrees on the members (membership.generations.agree), builds this rank's
data-parallel group (one per (tp, pp) position, groups.py), re-shards a sharded optimizer state
over the members (zero.py), hands any joiners the training state (transfer.py), and computes the
cover map (topology.ring_cover) and the plan (cover_plan.py: the fold, from the micro-batch costs
the members posted with their check-in, costs.py). A generation is usable only once every
member's group is built and every joiner holds the state: one outcome for all members
(`Membership.generations.formed`). If either fails (a member died after the agreement, the donor died
mid-transfer), nobody trains in it and the same candidates agree on the next generation; joiners
still without state are joiners again there. It returns what the runtime installs (`Generation`).
"""

from __future__ import annotations

import dataclasses
import time
from datetime import timedelta
from typing import Any, Callable, List, Optional, Sequence, Tuple

from megatron_mecefo.config import MeCeFOConfig
from megatron_mecefo.elastic.comm import groups
from megatron_mecefo.elastic.comm.transfer import broadcast_state
from megatron_mecefo.elastic.faults import holds
from megatron_mecefo.elastic.faults.inject import FaultInjector
from megatron_mecefo.elastic.membership import Agreement, Membership, keys
from megatron_mecefo.elastic.plan.costs import CostMeter, read_costs, summarize_costs
from megatron_mecefo.elastic.plan.cover_plan import CoverPlan, plan_cover
from megatron_mecefo.elastic.plan.fold import Fold
from megatron_mecefo.elastic.plan.topology import CoverMap, Grid, ring_cover
from megatron_mecefo.errors import GaveUp, JobFinished, MeCeFOError, NoCoverAvailable

__all__ = ["Formation", "Generation"]


@dataclasses.dataclass(frozen=True)
class Generation:
    """A formed generation, as this rank installs it."""

    number: int
    step: int
    """The step it starts at (the members' newest committed state)."""
    members: Tuple[int, ...]
    joiners: Tuple[int, ...]
    group: Any
    """This rank's data-parallel group (its (tp, pp) position's members)."""
    cover: CoverMap
    """Who covers whom by the ring (where the sharded state's copies are; "spread" deals wider)."""
    plan: CoverPlan
    """Which live replica runs which micro-batch, in which mode (cover_plan.py)."""
    state: Optional[bytes]
    """The training state this rank received as a joiner; None on a rank that held it."""
    t_agreed: float
    """time.monotonic() when the members were agreed."""
    rolled: Tuple[int, ...] = ()
    """Members that commit the step before `step` with their own reduced gradients (Agreement.rolled)."""

    @property
    def fold(self) -> Fold:
        return self.plan.fold


class Formation:
    """Builds the generations of one rank (see the module docstring). `get_state` is the host's
    training state a donor sends; `sharding` the sharded optimizer state (None: replicated)."""

    def __init__(self, config: MeCeFOConfig, grid: Grid, rank: int, store, membership: Membership,
                 injector: FaultInjector, events, log, *, micro_batches: int, sharding,
                 get_state: Optional[Callable[[], Any]], backend: str, costs: CostMeter) -> None:
        self.cfg, self.grid, self.rank, self.store, self.membership = config, grid, rank, store, membership
        self.injector, self.events, self.log = injector, events, log
        self.k, self.sharding, self.backend, self.costs = micro_batches, sharding, backend, costs
        self._get_state = get_state or (lambda: None)
        self._timeout = timedelta(seconds=config.collective_timeout_s)
        self.position = grid.position(rank)

    def request_join(self, incarnation: int, deadline: float) -> Tuple[int, List[int]]:
        """A restarted rank asks to come back (once the job reached its pinned rejoin step, if any:
        a trace's or a hold's); returns the generation that admits it and that generation's candidates."""
        holds.wait_for_rejoin_step(self.injector.rejoin_step(self.rank, incarnation), self.membership,
                                   deadline=deadline)
        # what "hold" rules wait for, once the request is counted: that step's commit admits it
        generation = self.membership.request_join(deadline, announced=lambda: self.membership.mark_rejoining(incarnation))
        self.injector.maybe_fire(self.membership.progress(), "join")
        return generation, [int(x) for x in self.store.get(keys.candidates(generation)).decode().split(",")]

    def form(self, generation: int, candidates: Sequence[int], step: Optional[int], reduced: bool = False) -> Generation:
        """Agree on and build generation `generation` (or a later one if it cannot form).

        Args:
            step: the step whose state this rank holds; None: it holds none (a joiner).
            reduced: it also holds that step's reduced gradients (membership.generations.agree).

        Raises:
            GaveUp: no cover for a failed replica (NoCoverAvailable, with `members`), a shard of
                the optimizer state lost, or the job aborted.
        """
        while True:
            agreed = self.membership.generations.agree(generation, candidates, step, info=self.costs.info(), summarize=summarize_costs,
                                           reduced=reduced)
            if generation > 0:
                self.injector.maybe_fire(agreed.step, "recovery")
            t_agreed = time.monotonic()
            cover = self._cover(generation, agreed)
            group, payload, sharded = None, None, None
            peers = [r for r in agreed.members if self.grid.position(r) == self.position]
            # a member that saw this generation fail says so (abort_step): the others stop waiting on
            # it at once, not after the collective timeout, and check in for the next one in time
            failed = lambda g=generation: self.membership.generations.not_formed(g)  # noqa: E731
            try:
                group = groups.build_dp_group(self.store, generation, peers, self.rank, self._timeout, self.backend,
                                              tag="t{}p{}".format(*self.position), should_abort=failed)
                if self.sharding is not None:  # first: it re-sends the parameters the joiners' state then holds
                    sharded = self.sharding.resharding.regroup(group, peers, [self.grid.replica_of(r) for r in peers],
                                                    [r for r in peers if r not in agreed.joiners], self.rank,
                                                    replicas_total=self.grid.dp,
                                                    midway=lambda: self.injector.maybe_fire(agreed.step, "reshard"),
                                                    should_abort=failed)
                if agreed.joiners:
                    payload = self._transfer_state(group, agreed, peers, step, failed)
                if not self.membership.generations.formed(generation, agreed.members):
                    raise MeCeFOError("another member's group or state transfer failed")
            except (GaveUp, JobFinished):  # JobAborted, or a shard of the optimizer state lost
                groups.destroy_group(group, self.cfg.collective_timeout_s)
                raise
            except groups.AbortHung:
                raise
            except Exception as e:  # a member died after the agreement or during the transfer
                groups.destroy_group(group, self.cfg.collective_timeout_s)
                self.membership.votes.abort(generation, agreed.step)
                self.log.warning("generation %d could not form (%s); agreeing again", generation,
                                 str(e).splitlines()[0][:120])
                self.events.write("regroup_failed", generation=generation, step=agreed.step, members=list(agreed.members),
                                  joiners=list(agreed.joiners), reason=str(e).splitlines()[0][:200])
                generation, candidates = generation + 1, agreed.members
                continue
            break
        if self.sharding is not None:
            self._install(sharded, generation, agreed.step)
        return Generation(number=generation, step=agreed.step, members=tuple(agreed.members),
                          joiners=tuple(agreed.joiners), group=group, cover=cover, plan=self._plan(cover, agreed),
                          state=payload if self.rank in agreed.joiners else None, t_agreed=t_agreed,
                          rolled=agreed.rolled)

    def _cover(self, generation: int, agreed: Agreement) -> CoverMap:
        try:
            return ring_cover(self.grid, agreed.members)
        except NoCoverAvailable as e:
            err = NoCoverAvailable(
                f"[gen {generation} rank {self.rank} step {agreed.step}] {e}. Survivors: {list(agreed.members)}. "
                "Restart the job from the checkpoint with the surviving nodes, or add nodes.")
            err.members = list(agreed.members)
            raise err from None

    def _plan(self, cover: CoverMap, agreed: Agreement) -> CoverPlan:
        """The generation's plan, from the costs its members posted (identical on every member)."""
        costs = read_costs(agreed.summary)
        budget = self.cfg.covering_budget
        return plan_cover(cover, self.k, costs, policy=self.cfg.cover,
                          target=None if budget is None else budget * self.k * costs.exact,
                          approximate=self.cfg.approximate if self.cfg.approximations_on else "none",
                          skip_attention=self.cfg.skip_attention, attention_floor=self.cfg.attention_floor)

    def _transfer_state(self, group, agreed: Agreement, peers: Sequence[int], held: Optional[int],
                        should_abort: Callable[[], bool]) -> Optional[bytes]:
        """The lowest state holder at this position broadcasts its training state (its shard) over
        the position's group, labelled with the step it holds (`held`; the joiners check it against
        the agreed one); returns the bytes."""
        donor = min(r for r in agreed.holders if r in peers)
        return broadcast_state(group, peers, self.rank, donor, self._get_state, step=held,
                               midway=lambda: self.injector.maybe_fire(agreed.step, "transfer"),
                               should_abort=should_abort)

    def _install(self, sharded, generation: int, step: int) -> None:
        self.sharding.resharding.install(sharded)
        lost = [list(r) for r in self.sharding.last_reshard.lost]
        if lost:  # on_shard_loss "reinit": these ranges' moments and step count restarted
            self.log.warning("optimizer state %s had no live holder: rebuilt (moments and step restarted)", lost)
            self.events.write("shard_reinit", generation=generation, step=step, ranges=lost,
                              elements=sum(b - a for a, b in lost), of=self.sharding.numel)
