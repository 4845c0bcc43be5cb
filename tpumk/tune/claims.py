"""Nothing evaluated twice within a study: the claim a trial makes on its configuration.

Processes coordinate through the study's storage itself (so this also works across machines on
PostgreSQL): each trial writes its `config_key` user attr (the "choosing" phase: done before
the trial looks for others), then takes a ticket one above the highest ticket any trial of that
key holds, and evaluates only if no other running trial of the key is still choosing a ticket
or holds a lower (ticket, trial number). That is Lamport's bakery algorithm over trial user
attrs; the others wait and reuse the owner's result (recorded as cached, `duplicate_of` = the
owner's number). A finished trial of the key is reused at once. An owner that dies is failed
by the heartbeat (tpumk.tune.storage.fail_stale) and the next waiter in ticket order takes over.
"""

from __future__ import annotations

import threading
import time

from tpumk.tune.budget import FINISHED, POLL_SECONDS, Interrupted, foreign, state
from tpumk.tune.storage import fail_stale

KEY_ATTR = "config_key"
TICKET_ATTR = "claim_ticket"


def _same_key(trial, key: str) -> list:
    return [t for t in trial.study.get_trials(deepcopy=False)
            if t.number != trial.number and t.user_attrs.get(KEY_ATTR) == key]


def claim(trial, key: str, stop: threading.Event, heartbeat: float, space):
    """Return a finished trial of the same configuration to reuse, or None once this trial
    owns the configuration and must evaluate it. The trial must have announced `key` in its
    `config_key` user attr first. A finished trial `foreign` to the study (`space`: another
    process wrote it, e.g. with a negative value) is never reused."""
    ticket = 1 + max((t.user_attrs.get(TICKET_ATTR, 0) for t in _same_key(trial, key)), default=0)
    trial.set_user_attr(TICKET_ATTR, ticket)
    mine = (ticket, trial.number)
    last_stale_check = time.monotonic()
    while True:
        same = _same_key(trial, key)
        done = sorted((t for t in same if state(t) in FINISHED and foreign(t, space) is None), key=lambda t: t.number)
        if done:
            return done[0]
        ahead = [t for t in same if state(t) == "RUNNING"
                 and (TICKET_ATTR not in t.user_attrs or (t.user_attrs[TICKET_ATTR], t.number) < mine)]
        if not ahead:
            return None
        if stop.is_set():
            raise Interrupted("interrupted while waiting for another trial of this configuration")
        if time.monotonic() - last_stale_check > heartbeat:
            fail_stale(trial.study)  # an owner that died must not hold its waiters forever
            last_stale_check = time.monotonic()
        time.sleep(POLL_SECONDS)
