import pytest
import torch

from asyncrl.weights.layout import ParamSpec, layout_hash, plan_buckets, specs_of, weights_checksum


def test_buckets_respect_size_and_dtype_and_keep_order():
    specs = [
        ParamSpec("a", (10,), torch.float32),
        ParamSpec("b", (20,), torch.float32),
        ParamSpec("c", (100,), torch.float32),
        ParamSpec("d", (4,), torch.bfloat16),
        ParamSpec("e", (4,), torch.float32),
    ]
    buckets = plan_buckets(specs, bucket_bytes=160)
    names = [[p.name for p in b.params] for b in buckets]
    assert names == [["a", "b"], ["c"], ["d"], ["e"]]  # c alone exceeds the size: own bucket
    assert [b.numel for b in buckets] == [30, 100, 4, 4]
    assert [p.name for b in buckets for p in b.params] == [s.name for s in specs]


def test_layout_hash_and_checksum_detect_differences():
    a = {"w": torch.ones(2, 3), "b": torch.zeros(3)}
    b = {"w": torch.ones(3, 2), "b": torch.zeros(3)}
    assert layout_hash(specs_of(a.items())) != layout_hash(specs_of(b.items()))
    c = {"w": torch.ones(2, 3), "b": torch.zeros(3)}
    assert weights_checksum(a.items()) == weights_checksum(c.items())
    c["b"][1] = 1e-30
    assert weights_checksum(a.items()) != weights_checksum(c.items())


@pytest.mark.parametrize("transport", ["gloo", "shm"])
def test_sync_reuses_released_staging_and_never_overwrites_an_unreleased_version(transport):
    """A real pair (sender thread, receiver here) sends three versions in 4 buckets: [a, b] and
    [d] (int64) packed, [c] and [big] (one tensor each) sent uncopied by gloo. Version 1 is kept
    unreleased while version 2 arrives: it must stay intact (gloo: fresh staging; shm: copied
    out of the slot before the claim lets the learner write it again); version 2 is released,
    so version 3 lands in its memory (gloo: the receiver's staging; shm: the learner's slot)."""
    import threading

    from asyncrl.weights.group import SyncGroup
    from asyncrl.weights.probe import PROBE_LEN, DeliveryProbe
    from asyncrl.weights.receiver import WeightReceiver
    from asyncrl.weights.sync import WeightBroadcaster
    from asyncrl.wire.sockets import free_port

    shapes = {"a": (8,), "b": (8,), "c": (8,), "big": (64,), "d": (8,)}
    dtypes = {"d": torch.int64}
    specs = [ParamSpec(n, s, dtypes.get(n, torch.float32)) for n, s in shapes.items()]
    port, cpu = free_port(), torch.device("cpu")
    sent_error: list[BaseException] = []
    probe = DeliveryProbe(-torch.arange(1.0, PROBE_LEN), tolerance=1e-4)

    def send():
        try:
            group = SyncGroup("127.0.0.1", port, 0, 2, cpu, timeout_s=60, transport=transport)
            broadcaster = WeightBroadcaster(group, bucket_bytes=64)  # 16 floats a bucket
            for v in (1, 2, 3):
                tensors = (torch.full(s.shape, v, dtype=s.dtype) for s in specs)
                broadcaster.broadcast(specs, tensors, v, probe if v == 2 else None)
            broadcaster.shutdown()
        except BaseException as e:  # surfaced by the assertion below
            sent_error.append(e)

    sender = threading.Thread(target=send)
    sender.start()
    group = SyncGroup("127.0.0.1", port, 1, 2, cpu, timeout_s=60, transport=transport)
    receiver = WeightReceiver(group, specs)
    first = receiver.receive()
    second = receiver.receive()  # `first` was not released: it must not be overwritten
    assert all(bool((t == 1).all()) for _, t in first.weights)
    assert all(bool((t == 2).all()) for _, t in second.weights)
    assert first.borrowed is False and second.borrowed is (transport == "shm")
    assert first.probe is None and isinstance(second.probe, DeliveryProbe)
    assert torch.equal(second.probe.logprobs, probe.logprobs)
    assert second.probe.tolerance == torch.tensor(1e-4).item()  # as float32 carries it
    second_ptrs = [t.data_ptr() for _, t in second.weights]
    assert second_ptrs != [t.data_ptr() for _, t in first.weights]
    second.release()
    third = receiver.receive()
    assert [t.data_ptr() for _, t in third.weights] == second_ptrs  # its staging, reused
    assert all(bool((t == 3).all()) for _, t in third.weights)
    assert [n for n, _ in third.weights] == list(shapes)
    assert receiver.receive() is None
    sender.join(timeout=60)
    assert not sent_error, sent_error


def test_a_dead_servers_cuda_slot_waits_for_its_next_epoch_and_goes_at_shutdown(monkeypatch):
    """torch never frees a CUDA block an importer that died still held open: rather than leak
    a version of GPU memory per restart, the learner keeps a dead epoch's CUDA slot and gives
    it to the same server's next epoch; at shutdown every slot goes."""
    import asyncrl.weights.staged_slots as staged_slots
    from asyncrl.weights.fanout import Fanout
    from asyncrl.weights.transports import CudaSlot

    class FakeCudaSlot(CudaSlot):  # the bookkeeping of a CUDA slot, in host memory
        def __init__(self, nbytes: int, device: torch.device):
            self.nbytes, self.tensor, self.closed = nbytes, torch.zeros(nbytes), False

        def close(self) -> None:
            self.closed = True

    monkeypatch.setattr(staged_slots, "make_slot", lambda t, n, d, tag: FakeCudaSlot(n, d))

    class Group:
        transport, staged = "cuda_ipc", True

        def abort(self) -> None:
            pass

    slots = staged_slots.StagedSlots(torch.device("cpu"))
    first = slots.for_version(Fanout({(0, 0): Group(), (1, 0): Group()}), 1024)
    slots.close(keep=[(1, 0)])  # server 0 epoch 0 died
    assert not first[(0, 0)].closed  # kept: its reader may never have let go
    again = slots.for_version(Fanout({(0, 1): Group()}), 1024)
    assert again[(0, 1)] is first[(0, 0)]  # the restarted server gets it back
    slots.close(keep_spares=False)
    assert first[(0, 0)].closed and first[(1, 0)].closed
