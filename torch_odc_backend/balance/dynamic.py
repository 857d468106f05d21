"""Dynamic balancing (decoupled mode only): each minibatch starts from an LB-Mini plan weighted
by the ranks' measured speeds, and ranks then *take* work as they become free, their own queue
first and then single items from the back of the fullest queue of another rank, each take an
atomic fetch-add on a counter of the group's store. A straggler hands its tail to the ranks that
are free, a rank that stays slow gets smaller shares in later plans, each microbatch is trained
exactly once, and ``odc.sync`` stays the one synchronisation (:class:`DynamicBatchSampler` shows
the training loop)."""
from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

import torch
from torch.utils.data import Sampler

from ._checks import _check_lengths
from .cost import CostModel, _eval_cost
from .plan import Plan, lb_mini_weighted
from .samplers import _Minibatches


def _odc_backend_of(group: Any) -> tuple[Any, str]:
    """The odc backend object of ``group`` and its device type (CUDA first, else CPU)."""
    import torch.distributed as dist

    from .._core import _C

    if not dist.is_initialized():
        raise RuntimeError("dynamic balancing needs an initialised process group on odc")
    pg = group if group is not None else dist.group.WORLD
    for device_type in ("cuda", "cpu"):
        try:
            backend = pg._get_backend(torch.device(device_type))
        except (RuntimeError, ValueError):
            continue
        if isinstance(backend, _C.OdcBackend):
            return backend, device_type
    raise ValueError("dynamic balancing needs a group whose backend is odc (e.g. init_process_group"
                     "(\"cpu:gloo,cuda:odc\")); this group has none: its ranks cannot share a counter")


class DynamicBalancer:
    """Shares each minibatch's work among the ranks of ``group`` as they become free.

    Every round (one :meth:`minibatch` call per minibatch, on every rank with the same
    arguments) starts from a plan: :func:`lb_mini_weighted` with the ranks' speeds measured
    in earlier rounds (equal speeds: plain LB-Mini). Rank ``r``'s microbatches form its
    queue, most expensive first; its last microbatch is kept as separate documents at the
    back of the queue. A rank takes work from the front of its own queue (the last
    microbatch's documents still there are trained together, as one microbatch); a rank
    whose queue is empty takes single items from the back of the queue with the most items
    left. Each take is an atomic fetch-add on a counter in the group's store (one per
    take from one's own queue, two per take from another's), so each item is trained by
    exactly one rank: a straggler (a throttled GPU, a longer microbatch than the cost model
    said) gives its tail to the ranks that are free, and a rank that stays slow gets a
    smaller share in the next plans.

    ``adapt=False`` keeps every plan at equal speeds (plain LB-Mini plus taking from others).
    ``take_from_others=False`` keeps each rank to its own queue: LB-Mini weighted by the
    measured speeds, nothing more, and a rank knows its last microbatch when it takes it
    (:meth:`MinibatchClaims.exhausted`). ``largest_last=True`` runs each queue cheapest
    first, so that a rank's last backward is its longest (with HSDP the cross-replica
    all-reduce started in the last backward hides behind it).
    Speeds: each rank publishes its seconds per unit of cost of a round when its claims run
    out (after waiting for its GPU to finish them, as ``odc.sync`` would), so before the
    round's ``odc.sync``; the next plan uses every rank's of the round before, smoothed with
    weight ``smoothing`` on the newest. A loop that stops iterating early publishes at the next
    :meth:`minibatch` call instead; the others' next plan then waits for it.

    Rules every rank must follow, since rounds are matched by their order:

    * every rank of ``group`` makes the same balancers in the same order (or passes the
      same ``name``) and calls :meth:`minibatch` the same number of times with the same
      lengths, token cap and cost model;
    * each round ends with a synchronisation of the whole group (``odc.sync`` in decoupled
      mode): rank 0 deletes a round's keys from the store three rounds later.

    On CUDA a rank takes work when its GPU is free enough: before taking, it waits until the
    GPU has finished all but ``ahead`` of the microbatches it handed out (``ahead=1``: the
    next one is taken while the GPU runs the current one, so the GPU does not idle for the
    host, and a rank holds at most one microbatch it has not started). Without the wait the
    host, which runs ahead of the GPU, would take work for a GPU that is still busy.
    """

    _instances: dict[str, int] = {}

    def __init__(self, group: Any = None, *, name: str | None = None, ahead: int = 1,
                 device: torch.device | str | None = None, adapt: bool = True,
                 smoothing: float = 0.5, take_from_others: bool = True,
                 largest_last: bool = False) -> None:
        import torch.distributed as dist

        self._backend, device_type = _odc_backend_of(group)
        if isinstance(ahead, bool) or not isinstance(ahead, int) or ahead < 0:
            raise ValueError(f"ahead must be a non-negative integer, got {ahead!r}")
        self.ahead = ahead
        if not (isinstance(smoothing, (int, float)) and 0 < smoothing <= 1):
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing!r}")
        self.smoothing = float(smoothing)
        self.adapt = bool(adapt)
        self.take_from_others = bool(take_from_others)
        self.largest_last = bool(largest_last)
        if name is None:  # the n-th balancer of this group, the same on every rank
            key = (group if group is not None else dist.group.WORLD).group_name
            count = DynamicBalancer._instances.get(key, 0)
            DynamicBalancer._instances[key] = count + 1
            name = f"balancer{count}"
        if not isinstance(name, str) or not name or "/" in name:
            raise ValueError(f"name must be a non-empty string without '/', got {name!r}")
        self.name = name
        if device is None:
            device = (torch.device("cuda", torch.cuda.current_device())
                      if device_type == "cuda" and torch.cuda.is_available() else torch.device("cpu"))
        self.device = torch.device(device)
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.round = 0
        #: per rank, smoothed seconds per unit of cost (None until measured)
        self.speeds: list[float | None] = [None] * self.world_size
        #: per round: the slowdowns its plan used, and what this rank took ("own"/"taken")
        self.history: list[dict[str, Any]] = []
        self._last: MinibatchClaims | None = None

    def _key(self, round_: int, what: str) -> str:
        return f"{self.name}/{round_}/{what}"

    def slowdowns(self) -> list[float]:
        """Each rank's time per unit of cost relative to the fastest (1.0 until measured)."""
        known = [s for s in self.speeds if s is not None]
        if not self.adapt or len(known) < self.world_size:
            return [1.0] * self.world_size
        fastest = min(known)
        return [s / fastest for s in known] if fastest > 0 else [1.0] * self.world_size

    def _between_rounds(self, round_: int) -> None:
        """Learn every rank's measurement of the last round (publishing this rank's if its
        claims did not run out); drop old keys."""
        if round_ >= 1 and self._last is not None:
            self._last._publish_speed()
        if round_ >= 1 and self.adapt:
            for r in range(self.world_size):
                busy, cost = (float(x) for x in self._backend.lookup(self._key(round_ - 1, f"speed{r}")).split())
                if cost > 0 and busy > 0:
                    new = busy / cost
                    old = self.speeds[r]
                    self.speeds[r] = new if old is None else old + self.smoothing * (new - old)
        if round_ >= 3 and self.rank == 0:
            for r in range(self.world_size):
                for what in (f"taken{r}", f"back{r}", f"speed{r}"):
                    self._backend.forget(self._key(round_ - 3, what))

    def minibatch(self, lengths: Sequence[int], max_tokens: int, cost: CostModel,
                  indices: Sequence[int] | None = None) -> MinibatchClaims:
        """Start the next round over a minibatch of samples with these token ``lengths``
        (identical on every rank); iterate the result for this rank's microbatches: lists of
        positions in ``lengths``, or of ``indices[position]`` when ``indices`` is given."""
        lengths = _check_lengths(lengths)
        if indices is not None and len(indices) != len(lengths):
            raise ValueError(f"indices has {len(indices)} entries for {len(lengths)} lengths")
        round_ = self.round
        self.round += 1
        self._between_rounds(round_)
        slowdowns = self.slowdowns()
        plan = lb_mini_weighted(lengths, slowdowns, max_tokens, cost)  # most expensive first
        if self.largest_last:
            plan = [list(reversed(rank_plan)) for rank_plan in plan]
        if indices is not None:
            plan = [[[indices[i] for i in mb] for mb in rank_plan] for rank_plan in plan]
        record: dict[str, Any] = {"slowdowns": slowdowns, "own": [], "taken": []}
        self.history.append(record)
        lookup = dict(zip(indices, lengths)) if indices is not None else dict(enumerate(lengths))
        claims = MinibatchClaims(self, round_, plan, lambda mb: _eval_cost(cost, [lookup[i] for i in mb]),
                                 record, sum(lengths))
        self._last = claims
        return claims


class MinibatchClaims:
    """This rank's share of one minibatch under dynamic balancing (:class:`DynamicBalancer`).

    Iterating it yields this rank's microbatches (lists of sample or dataset indices), each
    taken only when the loop asks for it; it can be iterated once. ``plan`` is the round's
    starting plan (every rank's queue), ``num_tokens`` the minibatch's token count (normalise
    the loss by it: the ranks' shares differ).
    """

    def __init__(self, balancer: DynamicBalancer, round_: int, plan: Plan,
                 cost_of: Callable[[list[int]], float], record: dict[str, Any], num_tokens: int) -> None:
        self._balancer = balancer
        self._round = round_
        self.plan = plan
        self.num_tokens = num_tokens
        self._cost_of = cost_of
        self._record = record
        # per rank: queue items (lists of indices) and their group (a microbatch's documents
        # at the back share one group and go together when their owner takes them)
        self._items: list[list[list[int]]] = []
        self._groups: list[list[int]] = []
        for rank_plan in plan:
            items, groups = [], []
            for g, mb in enumerate(rank_plan):
                if g == len(rank_plan) - 1 and len(mb) > 1:
                    items += [[i] for i in mb]
                    groups += [g] * len(mb)
                else:
                    items.append(list(mb))
                    groups.append(g)
            self._items.append(items)
            self._groups.append(groups)
        self._front = 0  # next item of this rank's own queue (only this rank takes from the front)
        self._own_done = False
        self._empty: set[int] = set()  # queues known to be exhausted
        self._done = False
        self._marks: list[Any] = []  # start of each microbatch handed out, then the end
        self._cost = 0.0
        self._published = False

    def __iter__(self) -> MinibatchClaims:
        return self

    # --- timing: when to take, and this rank's speed

    def _mark(self) -> Any:
        if self._balancer.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self._balancer.device))
            return event
        import time

        return time.perf_counter()

    def _wait_for_device(self) -> None:
        """Mark the end of the last microbatch's work; block until the GPU has at most
        ``ahead`` handed-out microbatches left to run."""
        if not self._marks:
            return
        self._marks.append(self._mark())
        ahead = self._balancer.ahead
        handed = len(self._marks) - 1  # microbatches handed out so far
        if self._balancer.device.type == "cuda" and handed >= 1:
            # mark k (k >= 1) ends microbatch k - 1; wait for the end of microbatch handed - 1 - ahead
            k = handed - ahead
            if k >= 1:
                self._marks[k].synchronize()

    def measure(self) -> tuple[float, float]:
        """(seconds this rank's microbatches took, their total cost): from the first one's
        start to the last one's end."""
        if len(self._marks) < 2 or self._cost <= 0:
            return 0.0, 0.0
        first, last = self._marks[0], self._marks[-1]
        if self._balancer.device.type == "cuda":
            last.synchronize()
            return first.elapsed_time(last) / 1e3, self._cost
        return last - first, self._cost

    def _publish_speed(self) -> None:
        """Share this rank's measurement of the round (once)."""
        if self._published:
            return
        busy, cost = self.measure()
        self._balancer._backend.publish(self._balancer._key(self._round, f"speed{self._balancer.rank}"),
                                        f"{busy!r} {cost!r}")
        self._published = True

    # --- taking work

    def _take(self, key: str, amount: int) -> int:
        return self._balancer._backend.claim(self._balancer._key(self._round, key), amount)

    def _own(self) -> list[int] | None:
        rank = self._balancer.rank
        items, groups = self._items[rank], self._groups[rank]
        f = self._front
        if f >= len(items):
            return None
        k = 1
        while f + k < len(items) and groups[f + k] == groups[f]:
            k += 1
        taken = self._take(f"taken{rank}", k)
        granted = max(0, min(k, len(items) - taken))
        if granted == 0:
            return None
        self._front += granted
        return [i for item in items[f:f + granted] for i in item]

    def _left(self, v: int) -> int:
        """Items left in rank v's queue (a read of its counter); a queue found empty is
        remembered as such (counters only grow)."""
        remaining = len(self._items[v]) - self._take(f"taken{v}", 0)
        if remaining <= 0:
            self._empty.add(v)
        return remaining

    def _steal(self) -> list[int] | None:
        me = self._balancer.rank
        while True:
            left = [(n, -v) for v in range(self._balancer.world_size)
                    if v != me and v not in self._empty and (n := self._left(v)) > 0]
            if not left:
                return None
            victim = -max(left)[1]
            if self._take(f"taken{victim}", 1) >= len(self._items[victim]):
                self._empty.add(victim)
                continue
            back = self._take(f"back{victim}", 1)
            return list(self._items[victim][len(self._items[victim]) - 1 - back])

    def exhausted(self) -> bool:
        """Whether no item is left that this rank could take (every queue's, or its own
        with ``take_from_others=False``; each asked once more at most): then the microbatch
        this rank took last is its last of the minibatch, and with HSDP
        ``odc.last_microbatch(model)`` before its backward starts the cross-replica
        all-reduces there. False while an item is left, even one another rank will take."""
        me = self._balancer.rank
        return not any(self._left(v) > 0 for v in range(self._balancer.world_size)
                       if v not in self._empty and (v == me or self._balancer.take_from_others))

    def __next__(self) -> list[int]:
        if self._done:
            raise StopIteration
        self._wait_for_device()
        mb = None
        if not self._own_done:
            mb = self._own()
            if mb is None:
                self._own_done = True
            else:
                self._record["own"].append(mb)
        if mb is None and self._balancer.take_from_others:
            mb = self._steal()
            if mb is not None:
                self._record["taken"].append(mb)
        if mb is None:
            self._done = True
            self._publish_speed()  # before this round's odc.sync: the next plan uses it
            raise StopIteration
        if not self._marks:
            self._marks.append(self._mark())  # the start of this rank's first microbatch
        self._cost += self._cost_of(mb)
        return mb


class DynamicBatchSampler(_Minibatches, Sampler[MinibatchClaims]):
    """Dynamic balancing over a map-style dataset: yields one :class:`MinibatchClaims` per
    minibatch; iterating that claims this rank's microbatches (lists of dataset indices).

    Minibatches are cut as :class:`BalancedBatchSampler` cuts them (same shuffle for the
    same ``seed`` and epoch) and shared as :class:`DynamicBalancer` describes (``group``,
    ``name``, ``ahead``, ``device``, ``adapt``, ``take_from_others`` and ``largest_last`` are
    its arguments). For decoupled mode
    only: exact-mode FSDP needs every rank to run the same number of microbatches. Each
    minibatch must end with ``odc.sync``::

        sampler = DynamicBatchSampler(lengths, max_tokens=65536, minibatch_size=64, cost=cost)
        for epoch in range(num_epochs):
            sampler.set_epoch(epoch)
            for claims in sampler:               # one per minibatch, the same on every rank
                for micro in claims:             # this rank's next microbatch, taken when it is free
                    batch = pack_documents([dataset[i] for i in micro])
                    (model(**batch).loss * batch_tokens(batch) / claims.num_tokens).backward()
                odc.sync(model)
                optimizer.step(); optimizer.zero_grad()

    With a DataLoader, make one per minibatch that loads in the training loop::

        loader = DataLoader(MicrobatchDataset(dataset, collate_fn), sampler=claims,
                            batch_size=None)   # per minibatch; num_workers=0: no claims ahead

    DataLoader workers would fetch (and so claim) ``num_workers * prefetch_factor``
    microbatches ahead and hoard work; loading in the training loop keeps the claims on
    demand, and with ``ahead=1`` the GPU runs the current microbatch while the next loads.
    """

    def __init__(self, lengths: Sequence[int], max_tokens: int, minibatch_size: int,
                 cost: CostModel, *, group: Any = None, name: str | None = None, ahead: int = 1,
                 device: torch.device | str | None = None, adapt: bool = True, seed: int = 0,
                 shuffle: bool = True, drop_last: bool = False, take_from_others: bool = True,
                 largest_last: bool = False) -> None:
        self._init_minibatches(lengths, max_tokens, minibatch_size, cost, seed, shuffle, drop_last)
        self.balancer = DynamicBalancer(group, name=name, ahead=ahead, device=device, adapt=adapt,
                                        take_from_others=take_from_others, largest_last=largest_last)

    def __iter__(self) -> Iterator[MinibatchClaims]:
        for index in range(len(self)):
            indices = self.minibatch_indices(index)
            yield self.balancer.minibatch([self.lengths[i] for i in indices], self.max_tokens,
                                          self.cost, indices=indices)
