"""Activations and their gradients across stage boundaries, where TP degrees may differ.

A boundary joins a sending stage of `a` ranks and a receiving stage of `b` ranks. Both sides hold
the whole [s, b, h] activation (replicated over TP). It is cut as one flat buffer, padded to a
multiple of lcm(a, b), into `a` equal parts on the sending side and `b` equal parts on the
receiving side; every (sender, receiver) pair whose parts overlap exchanges that overlap, so all
links work at once, and the receivers all-gather their parts inside their TP group. Gradients go
back the mirror way. The object has the six methods megatron-core's 1F1B schedule calls.

Under sequence parallelism a stage of TP degree t holds only its part of the activation: the
t-th of the sequence, [s/t, b, h], for TP rank i the sequence positions [i s/t, (i+1) s/t). As s
is the leading dimension, that part is exactly the flat buffer's i-th of t equal parts (t divides
s, so there is no padding). The same exchange therefore moves sequence parts between stages of
any two TP degrees; only the all-gather is left out, and a rank sends and receives nothing but
its own part. A TP-1 stage holds the whole sequence, its one part.

Order of the point-to-point operations. On NCCL a rank's sends and receives to a peer run one
after another on one stream, and a large send does not finish before its receive is posted
(NVIDIA/nccl#479). So the order must be safe when every rank blocks on one operation at a time,
in posting order. Rule, for one call of the schedule (each of the six touches one boundary): a
rank of an even stage posts its sends, then its receives; a rank of an odd stage its receives,
then its sends (megatron-core's `_p2p_ops` rule); within the sends, and within the receives,
peers go in increasing launch rank.

Why no cycle of waits can form. 1F1B pairs the calls on a boundary: each call one stage makes
there is met by one call of the neighbour stage that carries the same messages (send_forward /
recv_forward, send_forward_recv_backward / send_backward_recv_forward, send_backward /
recv_backward), and all ranks of a stage make the same calls and the same TP collectives. Treat
the schedule with one process per stage, every matched pair of calls one atomic exchange (what
batched p2p gives, and what megatron-core's schedule is built on): it completes, so its events
(matched pairs, and each stage's internal collectives) have one total order that every stage's
own order follows. Inside a matched pair, number the messages: first the direction the even
stage sends (its sends go first, and the odd stage's receives, which it posts first, are the
same messages), then by (sender launch rank, receiver launch rank). Every rank posts its part of
a pair in increasing number: a sender's messages share the sender, a receiver's the receiver,
and peers go by launch rank. Now each rank performs its blocking operations in increasing order
of (event, number). Take the smallest unfinished operation: each of its ranks has finished all
its smaller operations and not this one, so each is at it; it completes. Hence there is always
progress and no cycle. With sends first on both sides (the old order), the first steady-state
exchange is a cycle of two: the stage-k rank blocks sending an activation to a stage-(k+1)
rank, which blocks sending a gradient back. The four one-way calls carry one direction, so
consistent peer order alone makes them safe.

`HEXI_STRICT_P2P=1` (for tests only) waits on each operation as soon as it is posted. gloo's
send already waits for the matching receive to be posted, whatever its size, so this runs the
worst NCCL case on CPU: a bad order hangs instead of slipping through.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist

from megatron_hexi.process_groups import StagePosition, group_order

if TYPE_CHECKING:
    from megatron.core.transformer import TransformerConfig

FORWARD_TAG = 1
BACKWARD_TAG = 2
STRICT_ENV = "HEXI_STRICT_P2P"

# Which side of a boundary this rank is on.
Side = Literal["sender", "receiver"]
# One posted point-to-point operation: (dist.isend or dist.irecv, buffer, peer launch rank, tag).
P2POp = tuple[Callable[..., Any], torch.Tensor, int, int]
# What the schedule passes as shapes, and gets back: one tensor or a list of one.
Shapes = Sequence[int] | list[Sequence[int]]
Received = torch.Tensor | None | list[torch.Tensor | None]


class Boundary:
    """One stage boundary seen from one rank: which slices go to or come from which peer."""

    def __init__(
        self,
        senders: Sequence[int],
        receivers: Sequence[int],
        numel: int,
        launch_of: Mapping[int, int],
        me: int,
    ) -> None:
        # Part order follows each group's rank order (torch sorts member launch ranks).
        self.senders = group_order(senders, launch_of)
        self.receivers = group_order(receivers, launch_of)
        a, b = len(self.senders), len(self.receivers)
        self.numel = numel
        self.padded = math.ceil(numel / math.lcm(a, b)) * math.lcm(a, b)
        self.launch_of = launch_of
        self.me = me
        self.send_part = self.padded // a
        self.recv_part = self.padded // b

    def _range(self, peer_list: list[int], part: int, rank: int) -> tuple[int, int]:
        i = peer_list.index(rank)
        return i * part, (i + 1) * part

    def overlaps(self, my_side: Side) -> list[tuple[int, int, int]]:
        """[(peer plan rank, start, end)] of the flat buffer this rank exchanges."""
        if my_side == "sender":
            mine = self._range(self.senders, self.send_part, self.me)
            peers, part = self.receivers, self.recv_part
        else:
            mine = self._range(self.receivers, self.recv_part, self.me)
            peers, part = self.senders, self.send_part
        out = []
        for peer in peers:
            lo, hi = self._range(peers, part, peer)
            start, end = max(lo, mine[0]), min(hi, mine[1])
            if start < end:
                out.append((peer, start, end))
        return out

    def my_part(self, my_side: Side) -> tuple[int, int]:
        if my_side == "sender":
            return self._range(self.senders, self.send_part, self.me)
        return self._range(self.receivers, self.recv_part, self.me)


class StageCommunicator:
    """Point-to-point for one pipeline, usable as megatron-core's `p2p_communicator`."""

    def __init__(
        self,
        config: TransformerConfig,
        position: StagePosition,
        tp_group: dist.ProcessGroup | None,
        tp_size: int,
        prev_boundary: Boundary | None,
        next_boundary: Boundary | None,
        dtype: torch.dtype,
        device: torch.device,
        sequence_parallel: bool = False,
    ) -> None:
        """`sequence_parallel`: this stage holds its TP rank's part of the sequence (module
        docstring), not the whole activation."""
        self.config = config
        self.pp_group = position
        self.tp_group = tp_group
        self.tp_size = tp_size
        self.prev = prev_boundary  # this rank is a receiver there
        self.next = next_boundary  # this rank is a sender there
        self.dtype = dtype
        self.device = device
        self.strict = os.environ.get(STRICT_ENV) == "1"
        self.sequence_parallel = sequence_parallel
        for b in (prev_boundary, next_boundary):
            if sequence_parallel and b is not None and b.padded != b.numel:
                raise ValueError(
                    f"sequence parallelism: a boundary of {b.numel} elements does not split "
                    f"evenly over {len(b.senders)} and {len(b.receivers)} ranks"
                )

    # -- primitives -------------------------------------------------------------------------
    @staticmethod
    def _ops(
        post: Callable[..., Any], flat: torch.Tensor, boundary: Boundary, side: Side, tag: int
    ) -> list[P2POp]:
        """(post, slice, peer launch rank, tag) for each peer, in increasing launch rank."""
        ops = [
            (post, flat[s:e], boundary.launch_of[peer], tag)
            for peer, s, e in boundary.overlaps(side)
        ]
        return sorted(ops, key=lambda op: op[2])

    def _order(self, sends: list[P2POp], recvs: list[P2POp]) -> list[P2POp]:
        """Even stages send first, odd stages receive first (module docstring: why)."""
        return sends + recvs if self.pp_group.rank() % 2 == 0 else recvs + sends

    def _assemble(
        self, flat: torch.Tensor, boundary: Boundary, side: Side, shape: tuple[int, ...]
    ) -> torch.Tensor:
        """All-gather every rank's part inside this stage's TP group, then shape the tensor;
        under sequence parallelism this rank's part is the tensor."""
        if self.sequence_parallel:
            lo, hi = boundary.my_part(side)
            return flat[lo:hi].view(shape).clone()
        if self.tp_size > 1:
            lo, hi = boundary.my_part(side)
            part = hi - lo
            pieces = list(flat.split(part))
            dist.all_gather(pieces, flat[lo:hi].clone(), group=self.tp_group)
        out = flat[: boundary.numel].view(shape).clone()
        return out

    def _exchange(
        self,
        send: tuple[torch.Tensor, Boundary, Side, int] | None = None,
        recv: tuple[Boundary, Side, int, tuple[int, ...]] | None = None,
    ) -> torch.Tensor | None:
        """Post the sends and receives of one schedule step in `_order`, then wait for them all
        (strict mode: wait on each as soon as it is posted)."""
        sends, recvs, received = [], [], None
        if send is not None:
            tensor, boundary, side, tag = send
            flat = torch.zeros(boundary.padded, dtype=self.dtype, device=self.device)
            lo = boundary.my_part(side)[0] if self.sequence_parallel else 0
            flat[lo : lo + tensor.numel()] = tensor.detach().reshape(-1)
            sends = self._ops(dist.isend, flat, boundary, side, tag)
        if recv is not None:
            boundary, side, tag, _ = recv
            received = torch.empty(boundary.padded, dtype=self.dtype, device=self.device)
            recvs = self._ops(dist.irecv, received, boundary, side, tag)
        works = []
        for post, buffer, peer, tag in self._order(sends, recvs):
            work = post(buffer, peer, tag=tag)
            if self.strict:
                work.wait()
            else:
                works.append(work)
        for work in works:
            work.wait()
        if recv is not None and received is not None:
            return self._assemble(received, recv[0], recv[1], recv[3])
        return None

    @staticmethod
    def _peer(boundary: Boundary | None) -> Boundary:
        """The boundary to a neighbouring stage, which the schedule only asks for where the
        stage has that neighbour."""
        if boundary is None:
            raise RuntimeError("p2p: no neighbouring stage on this side (schedule bug)")
        return boundary

    @staticmethod
    def _got(t: torch.Tensor | None) -> torch.Tensor:
        """What an exchange with a receive returned (always a tensor)."""
        if t is None:
            raise RuntimeError("p2p: a receive returned nothing")
        return t

    @staticmethod
    def _one(tensors: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
        return tensors[0] if isinstance(tensors, list) else tensors

    @staticmethod
    def _shape(shapes: Shapes) -> tuple[int, ...]:
        return tuple(shapes[0]) if isinstance(shapes, list) else tuple(shapes)

    # -- the schedule's interface -----------------------------------------------------------
    def recv_forward(self, tensor_shapes: Shapes, is_first_stage: bool) -> Received:
        t = None
        if not is_first_stage:
            t = self._got(
                self._exchange(
                    recv=(
                        self._peer(self.prev),
                        "receiver",
                        FORWARD_TAG,
                        self._shape(tensor_shapes),
                    )
                )
            )
            t.requires_grad_(True)
        return [t] if isinstance(tensor_shapes, list) else t

    def recv_backward(self, tensor_shapes: Shapes, is_last_stage: bool) -> Received:
        t = None
        if not is_last_stage:
            t = self._exchange(
                recv=(self._peer(self.next), "sender", BACKWARD_TAG, self._shape(tensor_shapes))
            )
        return [t] if isinstance(tensor_shapes, list) else t

    def send_forward(
        self, output_tensors: torch.Tensor | list[torch.Tensor], is_last_stage: bool
    ) -> None:
        if not is_last_stage:
            self._exchange(
                send=(self._one(output_tensors), self._peer(self.next), "sender", FORWARD_TAG)
            )

    def send_backward(
        self, input_tensor_grads: torch.Tensor | list[torch.Tensor], is_first_stage: bool
    ) -> None:
        if not is_first_stage:
            self._exchange(
                send=(
                    self._one(input_tensor_grads),
                    self._peer(self.prev),
                    "receiver",
                    BACKWARD_TAG,
                )
            )

    def send_forward_recv_backward(
        self,
        output_tensors: torch.Tensor | list[torch.Tensor],
        tensor_shapes: Shapes,
        is_last_stage: bool,
    ) -> Received:
        t = None
        if not is_last_stage:
            t = self._exchange(
                send=(self._one(output_tensors), self._peer(self.next), "sender", FORWARD_TAG),
                recv=(self._peer(self.next), "sender", BACKWARD_TAG, self._shape(tensor_shapes)),
            )
        return [t] if isinstance(tensor_shapes, list) else t

    def send_backward_recv_forward(
        self,
        input_tensor_grads: torch.Tensor | list[torch.Tensor],
        tensor_shapes: Shapes,
        is_first_stage: bool,
    ) -> Received:
        t = None
        if not is_first_stage:
            prev = self._peer(self.prev)
            t = self._got(
                self._exchange(
                    send=(self._one(input_tensor_grads), prev, "receiver", BACKWARD_TAG),
                    recv=(prev, "receiver", FORWARD_TAG, self._shape(tensor_shapes)),
                )
            )
            t.requires_grad_(True)
        return [t] if isinstance(tensor_shapes, list) else t
