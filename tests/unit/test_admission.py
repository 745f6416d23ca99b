import random

import pytest

from replay.admission import AdmissionController


def test_synchronous_case_grants_one_batch_per_version():
    adm = AdmissionController(max_staleness=0, groups_per_batch=4, capacity_groups=100)
    assert adm.grantable(server_version=0, wanted=10, held=0) == 4
    adm.on_issued(4)
    assert adm.grantable(0, 10, held=4) == 0
    # consuming the batch does not reopen version 0: those slots were trained
    assert adm.grantable(0, 10, held=0) == 0
    assert adm.grantable(1, 10, held=0) == 4
    assert adm.grantable(1, 3, held=0) == 3  # never more than asked for


def test_staleness_bound_in_groups():
    # (s + S + 1) * B = (0 + 2 + 1) * 3 = 9 groups may be in play at version 0
    adm = AdmissionController(max_staleness=2, groups_per_batch=3, capacity_groups=100)
    assert adm.grantable(0, 100, held=0) == 9
    adm.on_issued(7)
    assert adm.grantable(0, 100, held=7) == 2
    assert adm.grantable(4, 100, held=7) == (4 + 3) * 3 - 7
    assert adm.grantable(-5, 100, held=0) == 0  # a server far behind starts nothing


def test_never_trained_groups_free_their_slots():
    adm = AdmissionController(max_staleness=0, groups_per_batch=2, capacity_groups=100)
    adm.on_issued(2)
    assert adm.grantable(0, 5, held=2) == 0
    adm.on_never_trained(1)  # one dropped as stale or expired
    assert adm.issued == 1
    assert adm.grantable(0, 5, held=1) == 1
    with pytest.raises(ValueError):
        adm.on_never_trained(2)


def test_capacity_is_back_pressure():
    adm = AdmissionController(max_staleness=100, groups_per_batch=4, capacity_groups=6)
    assert adm.grantable(0, 10, held=0) == 6
    assert adm.grantable(0, 10, held=5) == 1
    assert adm.grantable(0, 10, held=6) == 0
    assert adm.grantable(0, 10, held=9) == 0  # never negative


def test_invalid_settings_are_refused():
    with pytest.raises(ValueError):
        AdmissionController(max_staleness=-1, groups_per_batch=1, capacity_groups=1)
    with pytest.raises(ValueError):
        AdmissionController(max_staleness=0, groups_per_batch=0, capacity_groups=1)


@pytest.mark.parametrize("max_staleness", [0, 1, 3])
def test_in_order_consumption_never_trains_beyond_the_bound(max_staleness):
    """Simulate lagging servers and an in-order learner (batch k at version k): every granted
    group is trained at floor(i / B) and that is within max_staleness of its lease version."""
    b = 4
    rng = random.Random(max_staleness)
    adm = AdmissionController(max_staleness, groups_per_batch=b, capacity_groups=1000)
    lease_versions: list[int] = []  # by issue index
    consumed = 0
    for _ in range(2000):
        learner_version = consumed // b
        if rng.random() < 0.5:
            server_version = max(0, learner_version - rng.randint(0, 3))
            k = adm.grantable(
                server_version, rng.randint(1, 6), held=len(lease_versions) - consumed
            )
            adm.on_issued(k)
            lease_versions += [server_version] * k
        elif len(lease_versions) - consumed >= b:
            consumed += b
    assert consumed >= 50 * b, "the simulation must make progress"
    for i, s in enumerate(lease_versions[:consumed]):
        assert i // b - s <= max_staleness
