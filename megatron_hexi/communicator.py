"""Activations and their gradients across stage boundaries, where TP degrees may differ.

A boundary joins a sending stage of `a` ranks and a receiving stage of `b` ranks. Both sides hold
the whole [s, b, h] activation (replicated over TP). It is cut as one flat buffer, padded to a
multiple of lcm(a, b), into `a` equal parts on the sending side and `b` equal parts on the
receiving side; every (sender, receiver) pair whose parts overlap exchanges that overlap, so all
links work at once, and the receivers all-gather their parts inside their TP group. Gradients go
back the mirror way. The object has the six methods megatron-core's 1F1B schedule calls.
"""
import math

import torch
import torch.distributed as dist

FORWARD_TAG = 1
BACKWARD_TAG = 2


class Boundary:
    """One stage boundary seen from one rank: which slices go to or come from which peer."""

    def __init__(self, senders, receivers, numel, launch_of, me):
        # Part order follows each group's rank order (torch sorts member launch ranks).
        self.senders = sorted(senders, key=launch_of.__getitem__)
        self.receivers = sorted(receivers, key=launch_of.__getitem__)
        a, b = len(self.senders), len(self.receivers)
        self.numel = numel
        self.padded = math.ceil(numel / math.lcm(a, b)) * math.lcm(a, b)
        self.launch_of = launch_of
        self.me = me
        self.send_part = self.padded // a
        self.recv_part = self.padded // b

    def _range(self, peer_list, part, rank):
        i = peer_list.index(rank)
        return i * part, (i + 1) * part

    def overlaps(self, my_side):
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

    def my_part(self, my_side):
        if my_side == "sender":
            return self._range(self.senders, self.send_part, self.me)
        return self._range(self.receivers, self.recv_part, self.me)


class StageCommunicator:
    """Point-to-point for one pipeline, usable as megatron-core's `p2p_communicator`."""

    def __init__(self, config, position, tp_group, tp_size, prev_boundary, next_boundary,
                 dtype, device):
        self.config = config
        self.pp_group = position
        self.tp_group = tp_group
        self.tp_size = tp_size
        self.prev = prev_boundary        # this rank is a receiver there
        self.next = next_boundary        # this rank is a sender there
        self.dtype = dtype
        self.device = device

    # -- primitives -------------------------------------------------------------------------
    def _post_sends(self, tensor, boundary, side, tag):
        flat = torch.zeros(boundary.padded, dtype=self.dtype, device=self.device)
        flat[:boundary.numel] = tensor.detach().reshape(-1)
        return [dist.isend(flat[s:e], boundary.launch_of[peer], tag=tag)
                for peer, s, e in boundary.overlaps(side)], flat

    def _post_recvs(self, boundary, side, tag):
        flat = torch.empty(boundary.padded, dtype=self.dtype, device=self.device)
        return [dist.irecv(flat[s:e], boundary.launch_of[peer], tag=tag)
                for peer, s, e in boundary.overlaps(side)], flat

    def _assemble(self, flat, boundary, side, shape):
        """All-gather every rank's part inside this stage's TP group, then shape the tensor."""
        if self.tp_size > 1:
            lo, hi = boundary.my_part(side)
            part = hi - lo
            pieces = list(flat.split(part))
            dist.all_gather(pieces, flat[lo:hi].clone(), group=self.tp_group)
        out = flat[:boundary.numel].view(shape).clone()
        return out

    def _exchange(self, send=None, recv=None):
        """Post every send and receive of one schedule step, then wait for all of them."""
        works, keep = [], []
        if send is not None:
            tensor, boundary, side, tag = send
            w, buf = self._post_sends(tensor, boundary, side, tag)
            works += w
            keep.append(buf)
        received = None
        if recv is not None:
            boundary, side, tag, shape = recv
            w, received = self._post_recvs(boundary, side, tag)
            works += w
        for w in works:
            w.wait()
        if recv is not None:
            return self._assemble(received, recv[0], recv[1], recv[3])
        return None

    @staticmethod
    def _one(tensors):
        return tensors[0] if isinstance(tensors, list) else tensors

    @staticmethod
    def _shape(shapes):
        return tuple(shapes[0]) if isinstance(shapes, list) else tuple(shapes)

    # -- the schedule's interface -----------------------------------------------------------
    def recv_forward(self, tensor_shapes, is_first_stage):
        t = None
        if not is_first_stage:
            t = self._exchange(recv=(self.prev, "receiver", FORWARD_TAG, self._shape(tensor_shapes)))
            t.requires_grad_(True)
        return [t] if isinstance(tensor_shapes, list) else t

    def recv_backward(self, tensor_shapes, is_last_stage):
        t = None
        if not is_last_stage:
            t = self._exchange(recv=(self.next, "sender", BACKWARD_TAG, self._shape(tensor_shapes)))
        return [t] if isinstance(tensor_shapes, list) else t

    def send_forward(self, output_tensors, is_last_stage):
        if not is_last_stage:
            self._exchange(send=(self._one(output_tensors), self.next, "sender", FORWARD_TAG))

    def send_backward(self, input_tensor_grads, is_first_stage):
        if not is_first_stage:
            self._exchange(send=(self._one(input_tensor_grads), self.prev, "receiver",
                                 BACKWARD_TAG))

    def send_forward_recv_backward(self, output_tensors, tensor_shapes, is_last_stage):
        t = None
        if not is_last_stage:
            t = self._exchange(send=(self._one(output_tensors), self.next, "sender", FORWARD_TAG),
                               recv=(self.next, "sender", BACKWARD_TAG, self._shape(tensor_shapes)))
        return [t] if isinstance(tensor_shapes, list) else t

    def send_backward_recv_forward(self, input_tensor_grads, tensor_shapes, is_first_stage):
        t = None
        if not is_first_stage:
            t = self._exchange(send=(self._one(input_tensor_grads), self.prev, "receiver",
                                     BACKWARD_TAG),
                               recv=(self.prev, "receiver", FORWARD_TAG, self._shape(tensor_shapes)))
            t.requires_grad_(True)
        return [t] if isinstance(tensor_shapes, list) else t
