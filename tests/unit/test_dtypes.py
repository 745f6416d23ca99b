import pytest
import torch

from asyncrl.dtypes import torch_dtype


def test_config_names_and_torch_spellings_name_the_same_dtype():
    for name, dtype in [
        ("float32", torch.float32),
        ("bfloat16", torch.bfloat16),
        ("float16", torch.float16),
    ]:
        assert torch_dtype(name) is dtype
        assert torch_dtype(str(dtype)) is dtype  # "torch.float32": how a layout spells it


@pytest.mark.parametrize("bad", ["float33", "torch.nn", "Tensor", "", "torch."])
def test_a_name_that_is_no_dtype_is_refused_by_name(bad):
    with pytest.raises(ValueError, match=repr(bad).replace(".", r"\.")):
        torch_dtype(bad)
