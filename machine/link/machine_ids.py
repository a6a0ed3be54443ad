"""Who this machine is: the id made with its database, every id it has had, the joined one.

The ids live in machine.db's settings: the id made with the database (never
changes), every id this machine has had (a JSON list, oldest first) and the
last id a control plane gave (from ``link.json``, :mod:`machine.link.identity`).
:func:`machine_ids` records ids first seen and returns the
:class:`~machine.models.MachineIds`; it runs inside one write transaction at
every start, so a crash records all of them or none, and the next start
records them again. An id once recorded stays one of this machine's own for
ever, so agents created before a join (or a join as a new machine) still run
here after it.
"""

from __future__ import annotations

import json
import logging
import sqlite3
from pathlib import Path

from machine.link import identity
from machine.models import MachineIds
from machine.storage import tables
from shared.errors import AgentsError
from shared.ids import new_id

__all__ = ["adopt_machine_id", "joined_id", "machine_ids"]

logger = logging.getLogger(__name__)

# Settings keys: the id made with the database (never changes), every id this
# machine has had (JSON list, oldest first), and the last id a control plane gave.
_LOCAL_ID = "machine_id"
_OWN_IDS = "own_machine_ids"
_JOINED_ID = "joined_machine_id"
# The id of the lost machine a stand-alone box took over (adopt_machine_id).
_ADOPTED_ID = "adopted_machine_id"


def joined_id(data_dir: Path) -> tuple[bool, str | None]:
    """(joined, the control plane's id for us) from ``link.json``.

    A damaged ``link.json`` still means joined; its id is then unknown here
    and the one recorded at an earlier start is used (see machine_ids).
    """
    if not identity.is_joined(data_dir):
        return False, None
    try:
        return True, identity.load_link(data_dir).machine_id
    except AgentsError as e:
        logger.error("cannot read the control-plane link record: %s", e)
        return True, None


def machine_ids(conn: sqlite3.Connection, joined: bool, link_id: str | None) -> MachineIds:
    """Record ids first seen now and return who this machine is.

    The id made with the database stays one of this machine's own ids for
    ever, so agents created before a join still run after it.
    """
    local = tables.get_setting(conn, _LOCAL_ID)
    if local is None:
        local = new_id("machine")
        tables.set_setting(conn, _LOCAL_ID, local)
    raw = tables.get_setting(conn, _OWN_IDS)
    own: list[str] = [str(i) for i in json.loads(raw)] if raw else [local]
    if local not in own:
        own.insert(0, local)
    if link_id is not None:
        if link_id not in own:
            logger.info("machine id %s (given at join) recorded as this machine's", link_id)
            own.append(link_id)
        if tables.get_setting(conn, _JOINED_ID) != link_id:
            tables.set_setting(conn, _JOINED_ID, link_id)
    encoded = json.dumps(own)
    if raw != encoded:
        tables.set_setting(conn, _OWN_IDS, encoded)
    canonical = tables.get_setting(conn, _ADOPTED_ID) or local
    if joined:
        canonical = link_id or tables.get_setting(conn, _JOINED_ID) or canonical
    if canonical not in own:  # an adopted id is recorded in own with it; never trust one
        own.append(canonical)
    return MachineIds(canonical=canonical, own=frozenset(own), joined=joined)


def adopt_machine_id(conn: sqlite3.Connection, machine_id: str) -> None:
    """Make ``machine_id`` (a lost machine's) this stand-alone machine's own and
    canonical id from the next start, in the caller's transaction."""
    raw = tables.get_setting(conn, _OWN_IDS)
    own: list[str] = [str(i) for i in json.loads(raw)] if raw else []
    if machine_id not in own:
        own.append(machine_id)
        tables.set_setting(conn, _OWN_IDS, json.dumps(own))
    tables.set_setting(conn, _ADOPTED_ID, machine_id)
    logger.info("machine id %s adopted: this machine takes it over", machine_id)
