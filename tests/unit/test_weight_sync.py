import torch

from asyncrl.weight_sync import ParamSpec, layout_hash, plan_buckets, specs_of, weights_checksum


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
