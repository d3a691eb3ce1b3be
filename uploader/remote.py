"""Remote config in the uploader: fetch the backend's agent config, keep what may be kept, tell the stages.

Owns: a thread that GETs {endpoint}/v1/agent-config at start and then every
remote_config_interval_s (its own HttpClient: same TLS, token and timeouts as
the uploads), hands the document to shared.remote_config.parse(), logs what it
refused (each key and value once), logs each change of an accepted key once,
and writes the overrides file for the collector and the workers only when the
overrides change (removing it when the backend has none). A failed fetch
(no connection, a timeout, a status other than 200 and 404, a reply that is
not an agent config) is logged once per episode and changes nothing: the last
accepted overrides stay in force, also across a restart of the uploader (the
file is in the runtime directory).

Must not: apply anything itself, or let a key other than
shared.remote_config.REMOTE_KEYS through.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from shared import config as config_mod
from shared import log as shared_log
from shared import remote_config
from uploader.http import HttpClient


def describe(overrides: dict[str, Any]) -> str:
    if not overrides:
        return "none (the local config is in force)"
    return ", ".join(f"{k}={remote_config.show(v)}" for k, v in sorted(overrides.items()))


class RemoteConfigFetcher:
    """Fetches the agent config from its own thread until stop()."""

    def __init__(
        self, client: HttpClient, local: config_mod.ProfilerConfig, run_dir: str, host: str, log: logging.Logger
    ) -> None:
        self.client = client
        self.local = local
        self.run_dir = run_dir
        self.host = host
        self.log = log
        self.log_once = shared_log.LogOnce(log)
        self.interval_s = local.remote_config_interval_s
        # The last accepted overrides: what the file says, from an earlier run or an earlier uploader.
        self.overrides = remote_config.read_overrides(run_dir, log)
        self.fetches = 0
        self.answered = False  # a fetch has succeeded in this run
        self.failures = 0  # failed fetches in a row (an episode)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="remote-config", daemon=True)

    def start(self) -> None:
        if self.overrides:
            self.log.info(
                "remote config: in force from before: %s; asking %s every %d s",
                describe(self.overrides),
                self.client.agent_config_url,
                self.interval_s,
            )
        else:
            self.log.info("remote config: asking %s every %d s", self.client.agent_config_url, self.interval_s)
        self._thread.start()

    def stop(self, join_s: float) -> bool:
        """Stop fetching; True if the thread ended within join_s (a fetch in flight is abandoned)."""
        self._stopping.set()
        self._thread.join(join_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while True:
            try:
                self.fetch_once()
            except Exception:  # a bug: say so, keep what is in force, try again next time
                self.log.exception("remote config: unexpected error; the overrides in force stay")
            if self._stopping.wait(self.interval_s):
                return

    def fetch_once(self) -> None:
        """One fetch and what follows from it."""
        self.fetches += 1
        reply = self.client.get_agent_config(self.host)
        if not reply.ok:
            self._failed(reply.reason)
            return
        try:
            overrides, refused = remote_config.parse(reply.doc)
        except remote_config.AgentConfigError as e:
            self._failed(f"the reply is not an agent config: {e}")
            return
        if self.failures:
            self.log.info("remote config: fetched again after %d failed attempt(s)", self.failures)
            self.failures = 0
        for r in refused:
            self.log_once(("refused", r.key, r.value_text), logging.WARNING, "%s", r.describe(self.local))
        for note in remote_config.without_effect(self.local, overrides):
            self.log_once(("no effect", note), logging.WARNING, "%s", note)
        if not self.answered:
            self.answered = True
            self.log.info("remote config: the backend sets %s", describe(overrides))
        if overrides != self.overrides:
            self._apply(overrides)

    def _apply(self, overrides: dict[str, Any]) -> None:
        try:
            remote_config.write_overrides(self.run_dir, overrides)
        except OSError as e:
            # Nothing changed for the stages; the next fetch tries again.
            self.log_once(
                ("write", str(e)),
                logging.ERROR,
                "remote config: cannot write %s: %s; the stages keep %s",
                remote_config.path(self.run_dir),
                e,
                describe(self.overrides),
            )
            return
        before = remote_config.effective(self.local, self.overrides)
        after = remote_config.effective(self.local, overrides)
        for key, old, new in remote_config.changes(before, after):
            note = "" if key in overrides else " (the local value: the backend no longer sets it)"
            self.log.info("remote config: %s %s -> %s%s", key, remote_config.show(old), remote_config.show(new), note)
        self.overrides = overrides

    def _failed(self, reason: str) -> None:
        self.failures += 1
        if self.failures == 1:
            self.log.warning(
                "remote config: cannot fetch %s: %s; in force: %s; trying again every %d s (logged "
                "once until a fetch succeeds)",
                self.client.agent_config_url,
                reason,
                describe(self.overrides),
                self.interval_s,
            )
