"""The replay's setup (`replay.components.setup_replay_components`) builds one admission
controller from the config and hands it to every desk that grants leases or frees their slots;
the lease desk reads only its `LeaseRules` of the config."""

from __future__ import annotations

from asyncrl.config import Config
from replay.admission import AdmissionController
from replay.components import setup_replay_components
from replay.leases import LeaseRules

CONFIG = Config.model_validate(
    {
        "rollout": {"n": 3, "max_concurrent_groups": 5, "num_servers": 2},
        "data": {"train_batch_size": 4},
        "replay": {"max_staleness": 2, "capacity_groups": 10, "lease_timeout_s": 30.0},
    }
)


def test_one_admission_controller_is_shared_by_the_desks():
    parts = setup_replay_components(CONFIG, b"s" * 32)
    assert parts.leases.admission is parts.admission
    assert parts.batches.admission is parts.admission
    assert parts.group_filter.admission is parts.admission
    adm = parts.admission
    assert (adm.max_staleness, adm.groups_per_batch, adm.capacity_groups) == (2, 4, 10)


def test_the_lease_desk_gets_only_its_rules():
    rules = LeaseRules.from_config(CONFIG)
    assert rules == LeaseRules(
        samples_per_prompt=3,
        max_concurrent_groups=5,
        num_servers=2,
        lease_timeout_s=30.0,
        max_group_failures=CONFIG.replay.max_group_failures,
    )
    assert setup_replay_components(CONFIG, b"s" * 32).leases.rules == rules


def test_a_resumed_admission_counts_the_trained_and_held_groups_as_issued():
    adm = AdmissionController.from_config(CONFIG)
    adm.on_resumed(version=3, held=2)
    assert adm.issued == 3 * 4 + 2
    assert adm.staleness_budget(3) == (3 + 2 + 1) * 4 - 14
