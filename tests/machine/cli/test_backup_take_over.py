"""A fresh stand-alone box takes over a lost one from its backups and recovery key
(machine.cli.take_over): one transaction restores the agents and adopts the
lost machine's id, so they run here and backups go on under its name."""

from __future__ import annotations

from pathlib import Path

import pytest

from machine.app import open_machine
from machine.backups.keys import has_standalone_recovery_key
from machine.cli.take_over import take_over
from machine.config import MachineConfig
from machine.link.identity import LINK_FILE
from shared.crypto import BoxKeyPair
from shared.errors import InvalidArgument, InvalidState


def _config(root: Path, backups: Path) -> MachineConfig:
    root.mkdir(parents=True, exist_ok=True)
    (root / "machine.toml").write_text(f'backup_target = "{backups}"\n')
    return MachineConfig.build(
        flags={"data_dir": str(root), "background_loops": False, "shutdown_grace_seconds": 0},
        env={},
        home=root.parent,
    )


async def _lost_machine(tmp_path: Path) -> tuple[str, list[str], BoxKeyPair, Path]:
    """A stand-alone machine with two agents (one archived) backed up to a folder
    with a recovery key: its id, its agents, the key, the folder."""
    backups = tmp_path / "lost-backups"
    async with open_machine(_config(tmp_path / "lost", backups)) as lost:
        recovery = lost.require_backups().create_recovery_key()
        a = (await lost.agents.create(name="a", folder=str(tmp_path))).id
        b = (await lost.agents.create(name="b", folder=str(tmp_path))).id
        await lost.agents.archive(b)
        await lost.require_backups().backup_now()
        return lost.ids.canonical, [a, b], recovery, backups


async def test_the_new_box_becomes_the_lost_machine_and_runs_its_agents(tmp_path: Path) -> None:
    lost_id, agents, recovery, backups = await _lost_machine(tmp_path)
    cfg = _config(tmp_path / "new", tmp_path / "new-backups")
    done = await take_over(cfg, source=str(backups), recovery=recovery)
    assert done.machine_id == lost_id
    assert done.previous_id != lost_id
    assert sorted(done.result.restored) == sorted(agents)
    assert done.recovery_key_kept and has_standalone_recovery_key(cfg.data_dir)

    async with open_machine(cfg) as new:
        assert new.ids.canonical == lost_id
        assert done.previous_id in new.ids.own  # its own id stays its own
        listed = {a.id: a for a in await new.agents.list(include_archived=True)}
        assert set(listed) == set(agents)
        assert all(a.local for a in listed.values())  # they run here, once unarchived
        assert (await new.agents.unarchive(agents[0])).state.value == "active"
        made = await new.agents.create(name="c", folder=str(tmp_path))
        assert made.origin_machine == lost_id
        # Later backups are sealed to the key the operator holds: it opens them.
        result = await new.require_backups().backup_now()
    async with open_machine(_config(tmp_path / "third", tmp_path / "third-backups")) as third:
        async with third.backups_at(str(tmp_path / "new-backups")) as engine:
            assert engine.machine_id == lost_id
            opened = await third.require_backups().restore(
                result.backup_id, recovery=recovery, engine=engine
            )
    assert made.id in opened.restored


async def test_a_box_with_agents_of_its_own_is_refused_and_left_as_it_was(
    tmp_path: Path,
) -> None:
    lost_id, _, recovery, backups = await _lost_machine(tmp_path)
    cfg = _config(tmp_path / "new", tmp_path / "new-backups")
    async with open_machine(cfg) as new:
        mine = (await new.agents.create(name="mine", folder=str(tmp_path))).id
        before = new.ids
    with pytest.raises(InvalidState, match="holds 1 agents of its own"):
        await take_over(cfg, source=str(backups), recovery=recovery)
    async with open_machine(cfg) as new:
        assert new.ids == before and lost_id not in new.ids.own
        assert [a.id for a in await new.agents.list(include_archived=True)] == [mine]


async def test_refusals_name_the_problem_and_adopt_nothing(tmp_path: Path) -> None:
    lost_id, _, recovery, backups = await _lost_machine(tmp_path)
    cfg = _config(tmp_path / "new", tmp_path / "new-backups")
    # Another key: the backup does not open, nothing is adopted.
    with pytest.raises(InvalidArgument, match="not sealed to this key"):
        await take_over(cfg, source=str(backups), recovery=BoxKeyPair.generate())
    async with open_machine(cfg) as new:
        assert lost_id not in new.ids.own
        own_backups = await new.require_backups().backup_now()
    assert own_backups.agents == 0
    # Its own backups: that is a restore, not a take-over.
    with pytest.raises(InvalidState, match="is .* already"):
        await take_over(cfg, source=str(tmp_path / "new-backups"), recovery=recovery)
    # Done once, a second time says so.
    await take_over(cfg, source=str(backups), recovery=recovery)
    with pytest.raises(InvalidState, match=f"this machine is {lost_id} already"):
        await take_over(cfg, source=str(backups), recovery=recovery)
    # A joined machine is replaced by a repair join.
    joined = _config(tmp_path / "joined", tmp_path / "joined-backups")
    (joined.data_dir / LINK_FILE).write_text("{}")
    with pytest.raises(InvalidState, match="joined to a control plane"):
        await take_over(joined, source=str(backups), recovery=recovery)
