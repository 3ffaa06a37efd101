"""`worker --hub http[s]://HOST:PORT[/PREFIX/]`: a poller, a worker that asks the HTTP job
API for work.

Loop: `GET /ping/?worker=NAME&wait=20&queues=A,B&labels=X,Y` (what it serves and
has); with a job, `PUT state=working` to
confirm it, run it, repeat that PUT every `--pulse` seconds while it runs (the
lease), and end with `PUT state=finished` (result) or `state=failed` (error); each PUT
shows the `lease` token the claim carried.
A 409 on the lease means the job was canceled or taken back: the job is
stopped at once and the poller asks for the next. While the controller is
unreachable it retries with capped backoff, logging once per outage.
Over https the controller's certificate is checked against the system's trust
store, or only against --ca-file; HTTPS_PROXY/HTTP_PROXY/NO_PROXY are honoured.
SIGTERM/SIGINT, or the end of the --exit-with-parent process: finish the
running job and report it (bounded by --drain-timeout), then exit 0
(worker/leaving.py).
"""

from __future__ import annotations

import codecs
import logging
import os
import socket
from typing import Any
from urllib.parse import quote

import trio

from controller import datagram as dg
from controller import tokens
from controller.client.http import AsyncHttpPool
from controller.client.http_endpoint import Endpoint, endpoint
from controller.declared import DEFAULT as DECLARED_DEFAULT
from controller.declared import Declared
from worker.errors import SetupError
from worker.leaving import leave_on_signals
from worker.output import SINK, OutputSink
from worker.progress import REPORTER, Reporter
from worker.runner import Runner, TaskFailed, take_usage

log = logging.getLogger("worker.poller")

# How long one /ping/ waits on the server for a job.
PING_WAIT = 20.0
# Most text of stderr one lease PUT carries (the rest of a burst is dropped, the end kept).
MAX_LOG = 64 * 1024
# Backoff while the controller cannot be reached.
RETRY_FIRST = 0.2
RETRY_MAX = 5.0


def read_token(path: str) -> str:
    try:
        return tokens.read_token(path)
    except ValueError as exc:
        raise SetupError(f"--token-file {exc}") from None


class Lines:
    """A job's stderr as whole lines of text for the lease PUTs' `log` (the controller keeps
    each entry as output, a line end added when it has none): a line still being written
    waits for its end, or for the job's end, unless it grows past MAX_LOG."""

    def __init__(self, sink: OutputSink) -> None:
        self.sink = sink
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._partial = ""

    def take(self, *, final: bool = False) -> str:
        text = self._partial + self._decoder.decode(self.sink.take(MAX_LOG), final=final)
        cut = len(text) if final or len(text) >= MAX_LOG else text.rfind("\n") + 1
        self._partial = text[cut:]
        return text[:cut]


class Poller:
    def __init__(
        self,
        hub: str,
        runner: Runner,
        *,
        name: str | None = None,
        token_file: str | None = None,
        ca_file: str | None = None,
        pulse_period: float = 1.0,
        drain_timeout: float = 30.0,
        declared: Declared = DECLARED_DEFAULT,
        parent_pid: int | None = None,
    ) -> None:
        try:
            self._where: Endpoint = endpoint(hub, ca_file=ca_file)
        except ValueError as exc:  # the URL, the CA file or a *_PROXY variable, named in it
            raise SetupError(f"--hub {hub}: {exc}") from None
        self.hub = hub.rstrip("/")
        self.runner = runner
        self.name = name or f"{socket.gethostname()}-{os.getpid()}"
        self._token = read_token(token_file) if token_file else None
        self.pulse_period = pulse_period
        self.drain_timeout = drain_timeout
        self.parent_pid = parent_pid  # its end drains the worker (None: not watched)
        # Every /ping/ says what the poller serves and has (labels only when it has some).
        self._declared = {"queues": ",".join(sorted(declared.queues))}
        if declared.labels:
            self._declared["labels"] = ",".join(sorted(declared.labels))
        self._draining = False
        self._reachable = True
        self._idle_scope = trio.CancelScope()  # the /ping/ in flight, if any

    async def run(self) -> int:
        http = AsyncHttpPool(self._where, token=self._token, timeout=PING_WAIT + 30)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._signals, nursery.cancel_scope)
                await self._loop(http)
                nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                await http.aclose()
        return 0

    async def _signals(self, scope: trio.CancelScope) -> None:
        await leave_on_signals(scope, self._drain, self.drain_timeout, self.parent_pid)

    async def _drain(self) -> None:
        self._draining = True
        self._idle_scope.cancel()  # an open /ping/ need not wait
        await trio.sleep_forever()  # run() ends when the loop has reported the running job

    async def _loop(self, http: AsyncHttpPool) -> None:
        delay = RETRY_FIRST
        while not self._draining:
            job = None
            with trio.CancelScope() as self._idle_scope:
                job = await self._ping(http)
                if job is None and not self._reachable:
                    delay = min(delay * 2, RETRY_MAX)
                    await trio.sleep(delay)
            if job is not None:
                delay = RETRY_FIRST
                await self._work(http, job)

    async def _ping(self, http: AsyncHttpPool) -> dict[str, Any] | None:
        query = {"worker": self.name, "wait": PING_WAIT, **self._declared}
        try:
            resp = await http.request("GET", "/ping/", query=query)
        except OSError as exc:  # refused, reset, timed out
            self._unreachable(str(exc) or type(exc).__name__)
            return None
        self._back()
        if resp.status == 204:
            return None
        if resp.status != 200:
            self._unreachable(f"/ping/ answered {resp.status}: {resp.text[:200]}")
            return None
        try:
            job: dict[str, Any] = resp.json()
        except ValueError:
            self._unreachable(f"/ping/ answered something not JSON: {resp.text[:200]}")
            return None
        return job

    async def _work(self, http: AsyncHttpPool, job: dict[str, Any]) -> None:
        job_id, task_id = job["id"], int(job["task_id"])
        # The claim's lease: every report on this job shows it, or the controller refuses it.
        lease = str(job.get("lease", ""))
        path = f"/job/{quote(job_id, safe='')}/"
        if not await self._put(http, path, {"state": "working"}, lease):
            return  # taken back before it started
        payload = dg.read_bytes(job, "payload") or b""
        outcome: dict[str, Any] = {}
        stderr = Lines(OutputSink(limit=MAX_LOG))
        reporter = Reporter()  # its progress: the latest goes with the next lease PUT
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                self._lease, http, path, lease, stderr, reporter, nursery.cancel_scope
            )
            # Set after the lease task started (it copied this task's context): the job's
            # stderr and logging go to the sink, the poller's own lines do not.
            token = SINK.set(stderr.sink)
            REPORTER.set(reporter)
            try:
                result = await self.runner(task_id, payload)
                outcome = {"state": "finished"}
                dg.put_bytes(outcome, "result", result)
            except TaskFailed as exc:
                outcome = {"state": "failed", "error": str(exc)[-4000:]}
            except Exception as exc:  # a bug in a runner must not kill the poller
                SINK.reset(token)  # the poller's own line, not the job's
                log.exception("job %s: runner crashed", job_id)
                outcome = {"state": "failed", "error": f"worker error: {exc}"}
            finally:
                SINK.set(None)
            nursery.cancel_scope.cancel()
        usage = take_usage()
        if outcome:
            if usage is not None:
                outcome["usage"] = usage
            rest = stderr.take(final=True)
            if rest:
                outcome["log"] = rest
            _put_progress(outcome, reporter)
            await self._put(http, path, outcome, lease)  # a 409: it was taken back

    async def _lease(
        self,
        http: AsyncHttpPool,
        path: str,
        lease: str,
        stderr: Lines,
        reporter: Reporter,
        job_scope: trio.CancelScope,
    ) -> None:
        """Renew the lease every pulse, carrying what the job wrote to stderr since the last
        and its latest progress."""
        while True:
            await trio.sleep(self.pulse_period)
            body: dict[str, Any] = {"state": "working"}
            lines = stderr.take()
            if lines:
                body["log"] = lines
            _put_progress(body, reporter)
            if not await self._put(http, path, body, lease):
                log.warning("%s was canceled or taken back: stopping it", path)
                job_scope.cancel()
                return

    async def _put(self, http: AsyncHttpPool, path: str, body: dict[str, Any], lease: str) -> bool:
        """False when the controller says this poller no longer holds the job (409/404)."""
        body = {**body, "worker": self.name, "lease": lease}
        while True:
            try:
                resp = await http.request("PUT", path, json=body)
            except OSError as exc:  # refused, reset, timed out
                self._unreachable(str(exc) or type(exc).__name__)
                await trio.sleep(RETRY_FIRST)
                continue
            self._back()
            if resp.status in (404, 409):
                return False
            return resp.status < 400

    def _unreachable(self, why: str) -> None:
        if self._reachable:
            log.warning("controller at %s unreachable: %s (retrying)", self.hub, why)
        self._reachable = False

    def _back(self) -> None:
        if not self._reachable:
            log.info("controller at %s reachable again", self.hub)
        self._reachable = True


def _put_progress(body: dict[str, Any], reporter: Reporter) -> None:
    """The job's latest progress in a PUT's body, when it reported one since the last."""
    value = reporter.take()
    if value is not None:
        body["progress"], body["status"] = value
