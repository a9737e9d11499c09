"""The console's pages: server-rendered HTML (Jinja2), refreshed in parts by htmx, with uPlot
for the one chart. Every answer comes from the service layer (``broker.service``, the same
``Service`` the binary protocol calls), never from the storage.

Routes (the broker's HTTP server mounts them at ``/``; its JSON API lives under ``/api``):

    GET  /                                   streams, with live produce and consume rates
    GET  /streams/rows                       the streams table's rows (htmx, every 2 s)
    GET  /stream?name=                       one stream: segments over time, rates, retention
    GET  /stream/rates.json?name=            the rate chart's points (uPlot, every 2 s)
    GET  /events?stream=[&before=|&after=|&at=]   the message browser (tail without a bound)
    GET  /subscriptions[?stream=]            subscriptions with lag and members
    GET  /subscription?stream=&name=         one subscription; POST /subscription/reset
    GET  /transactions                       open transactions; POST /transactions/abort
    GET  /spark[?query=]                     Spark sink queries (last batch, rate) and the
                                             subscriptions queries read through (lag)
    GET  /spark/rows[?query=]                the queries table's rows (htmx, every 2 s)
    GET  /static/...                         CSS, htmx and uPlot (vendored, no build step)

Errors render a page with the error's text: 404 for an unknown stream, subscription or
segment, 400 for a bad argument, 409 for any other refusal (the error's code is shown).
The forms (reset, abort) act for the logged-in caller. With authentication on (``up
--auth``) every page needs a token: ``GET /login`` shows a form, ``POST /login`` checks the
token and keeps it in an HttpOnly, SameSite=Strict cookie (Secure over HTTPS) that lives as
long as the token, ``POST /logout`` drops it; a page without a valid cookie (or ``Authorization:
Bearer`` header) redirects to the login form (an htmx refresh gets 401 and ``HX-Redirect``).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlencode, urlsplit

import jinja2
import msgspec
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from .. import __version__
from .._errors import (
    AuthenticationFailed,
    InvalidArgument,
    InvalidName,
    MalformedValue,
    OffsetOutOfRange,
    SlipstreamError,
)
from ..broker import MAX_PAGE_EVENTS
from ..protocol import IdentityInfo, StreamInfo, SubscriptionInfo
from ..streams import format_positions, human_bytes
from ._browse import EventPage, found_page, shown_page
from ._sampler import Commit, CommitSampler, RateSampler
from ._svg import segments_svg

if TYPE_CHECKING:
    from ..broker import Broker, Caller, Service

HERE = Path(__file__).parent
#: streams per page of the streams list (a filter narrows 10,000 streams to the ones you want)
STREAMS_PER_PAGE = 100
EVENTS_PER_PAGE = 50
MAX_FORM_BYTES = 16 * 1024
#: the console's login cookie (HttpOnly, SameSite=Strict): the token a login form checked
TOKEN_COOKIE = "slipstream_token"
_BAD_REQUEST = (InvalidArgument, InvalidName, MalformedValue, OffsetOutOfRange)

_templates = jinja2.Environment(
    loader=jinja2.FileSystemLoader(HERE / "templates"),
    autoescape=True,
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
)


def routes(broker: Broker) -> list[BaseRoute]:
    """The console's routes, for the broker's HTTP server to mount at ``/``. ``broker.service``
    is read at each request (it exists once the broker has opened its data directory)."""
    return Console(broker).routes()


class Console:
    """Page handlers over one broker's service, with the rate sampler they share (see
    ``_sampler``: the handlers run on the broker's event loop, its only user)."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self.sampler = RateSampler()
        self.commits = CommitSampler()

    def routes(self) -> list[BaseRoute]:
        page = self._page
        return [
            Route("/", page(self.streams)),
            Route("/streams/rows", page(self.stream_rows)),
            Route("/stream", page(self.stream)),
            Route("/stream/rates.json", page(self.stream_rates)),
            Route("/events", page(self.events)),
            Route("/subscriptions", page(self.subscriptions)),
            Route("/subscription", page(self.subscription)),
            Route("/subscription/reset", page(self.reset_subscription), methods=["POST"]),
            Route("/transactions", page(self.transactions)),
            Route("/spark", page(self.spark_queries)),
            Route("/spark/rows", page(self.spark_rows)),
            Route("/transactions/abort", page(self.abort_transaction), methods=["POST"]),
            Route("/login", self.login_form, methods=["GET"]),
            Route("/login", self.login, methods=["POST"]),
            Route("/logout", self.logout, methods=["POST"]),
            Mount("/static", StaticFiles(directory=HERE / "static"), name="console-static"),
        ]

    @property
    def service(self) -> Service:
        return self.broker.service

    def _page(
        self, handler: Callable[[Request, Caller], Awaitable[Response]]
    ) -> Callable[[Request], Awaitable[Response]]:
        """A handler run for a caller of its own, its typed errors rendered as a page."""

        async def endpoint(request: Request) -> Response:
            peer = f"console {request.client.host if request.client else 'unknown'}"
            caller = self.service.connect(peer)
            try:
                self.service.authenticate(caller, _credentials(request))
            except AuthenticationFailed:
                self.service.disconnect(caller)
                return _to_login(request)
            try:
                return await handler(request, caller)
            except SlipstreamError as exc:
                metrics = getattr(self.broker, "metrics", None)
                if metrics is not None:  # counted as the API's error answers are
                    metrics.rejected(exc.code)
                return _error_page(request, exc)
            finally:
                self.service.disconnect(caller)

        return endpoint

    # --- login (authentication on) ------------------------------------------------------------

    async def login_form(self, request: Request) -> Response:
        if not self.service.auth:
            return RedirectResponse("/", status_code=303)
        return render("login.html", request, next=_next_page(request), message="")

    async def login(self, request: Request) -> Response:
        """Check the token of the form and keep it in the console's cookie."""
        try:
            fields = await _form(request)
        except SlipstreamError as exc:
            return _error_page(request, exc)
        token = fields.get("token", "").strip()
        target = _next_page(request, fields.get("next"))
        if not self.service.auth:
            return RedirectResponse(target, status_code=303)
        peer = f"console {request.client.host if request.client else 'unknown'}"
        caller = self.service.connect(peer)
        try:
            self.service.authenticate(caller, {"token": token} if token else None)
        except AuthenticationFailed as exc:
            return render("login.html", request, status=401, next=target, message=exc.message)
        finally:
            self.service.disconnect(caller)
        principal = caller.principal
        assert principal is not None
        response = RedirectResponse(target, status_code=303)
        lifetime = None
        if principal.expires_at is not None:
            lifetime = max(1, principal.expires_at - int(time.time()))
        response.set_cookie(
            TOKEN_COOKIE,
            token,
            max_age=lifetime,
            path="/",
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
        )
        return response

    async def logout(self, request: Request) -> Response:
        response = RedirectResponse("/login" if self.service.auth else "/", status_code=303)
        response.delete_cookie(TOKEN_COOKIE, path="/", httponly=True, samesite="strict")
        return response

    # --- streams -----------------------------------------------------------------------------

    async def streams(self, request: Request, caller: Caller) -> Response:
        listing = await self._stream_listing(request, caller)
        return render("streams.html", request, **listing)

    async def stream_rows(self, request: Request, caller: Caller) -> Response:
        listing = await self._stream_listing(request, caller)
        return render("_stream_rows.html", request, **listing)

    async def _stream_listing(self, request: Request, caller: Caller) -> dict[str, Any]:
        query = request.query_params.get("q", "").strip()
        page_number = _int(request, "page", 1, minimum=1)
        streams = await self.service.list_streams_live(caller)
        if query:
            streams = [s for s in streams if query in s.name]
        streams.sort(key=lambda s: s.name)
        pages = max(1, -(-len(streams) // STREAMS_PER_PAGE))
        page_number = min(page_number, pages)
        shown = streams[(page_number - 1) * STREAMS_PER_PAGE : page_number * STREAMS_PER_PAGE]
        rows = []
        for info in shown:
            await self._sample(caller, info)
            rows.append(_stream_row(info, self.sampler.rates(info.name, info.created_ms)))
        return {
            "rows": rows,
            "query": query,
            "page": page_number,
            "pages": pages,
            "total": len(streams),
        }

    async def _sample(self, caller: Caller, info: StreamInfo) -> None:
        """Record a sample of one stream's counters (if the sampler wants one now)."""
        if not self.sampler.wants(info.name, info.created_ms):
            return
        ends = {s.number: s.end_offset for s in info.segments}
        consumed = _consumed_events(self.broker, info.name)
        if consumed is None:  # a broker without metrics: what its subscriptions consumed
            consumed = 0
            for summary in self.service.list_subscriptions(caller, info.name):
                detail = await self.service.describe_subscription(caller, info.name, summary.name)
                consumed += sum(s.position for s in detail.segments)
        self.sampler.observe(info.name, info.created_ms, ends, consumed)

    async def stream(self, request: Request, caller: Caller) -> Response:
        name = _required(request, "name")
        info = await self.service.stream_info(caller, name)
        await self._sample(caller, info)
        rates = self.sampler.rates(info.name, info.created_ms)
        history = self.service.scale_history(caller, name)
        subscriptions = [
            _subscription_row(await self.service.describe_subscription(caller, name, s.name))
            for s in self.service.list_subscriptions(caller, name)
        ]
        segments = [
            {
                "info": s,
                "rate": rates.segments.get(s.number),
                "events": s.end_offset - s.start_offset,
                "key_range": f"{s.key_lo:#018x}..{s.key_hi:#018x}",
                "share": (s.key_hi - s.key_lo + 1) / (1 << 64),
            }
            for s in sorted(info.segments, key=lambda s: (s.sealed, s.number))
        ]
        return render(
            "stream.html",
            request,
            info=info,
            row=_stream_row(info, rates),
            segments=segments,
            svg=segments_svg(info, history),
            history=history,
            subscriptions=[s for s in subscriptions if s["members"]],
            progress_only=[s for s in subscriptions if not s["members"]],
        )

    async def stream_rates(self, request: Request, caller: Caller) -> Response:
        name = _required(request, "name")
        info = await self.service.stream_info(caller, name)
        await self._sample(caller, info)
        points = self.sampler.history(info.name, info.created_ms)
        return JSONResponse(
            {
                "t": [ms / 1000 for ms, _, _ in points],
                "produce": [round(p, 1) for _, p, _ in points],
                "consume": [None if c is None else round(c, 1) for _, _, c in points],
            }
        )

    # --- the message browser -----------------------------------------------------------------

    async def events(self, request: Request, caller: Caller) -> Response:
        name = _required(request, "stream")
        info = self.service.describe_stream(caller, name)
        params = request.query_params
        limit = _int(request, "limit", EVENTS_PER_PAGE, minimum=1, maximum=MAX_PAGE_EVENTS)
        at_text = params.get("at", "").strip()
        key = params.get("key", "")
        tail = False
        browse = functools.partial(self.service.browse_events, caller, name, limit=limit)
        if key:
            page = await self._find(caller, info, key, at_text, limit)
        elif at_text:
            page = shown_page(await browse(at="time", timestamp_ms=parse_time(at_text)))
        elif params.get("after"):
            page = shown_page(await browse(after=params["after"]))
        elif params.get("before"):
            page = shown_page(await browse(before=params["before"]))
        else:
            tail = True
            page = shown_page(await browse())
        template = "_events.html" if request.headers.get("HX-Request") else "events.html"
        return render(
            template,
            request,
            info=info,
            page=page,
            tail=tail,
            limit=limit,
            at=at_text,
            key=key,
            links=_page_links(page),
            find_available=_find_available(self.service),
        )

    async def _find(
        self, caller: Caller, info: StreamInfo, key: str, at_text: str, limit: int
    ) -> EventPage:
        """The newest ``limit`` events with routing key ``key`` (from ``at`` on, if given),
        from the broker's key index (``Service.find_events``), not a scan."""
        find = getattr(self.service, "find_events", None)
        if find is None:
            raise InvalidArgument("find by key needs the broker's key index; this build has none")
        start_ms = parse_time(at_text) if at_text else None
        found = await find(caller, info.name, key=key, start_ms=start_ms, limit=limit)
        return found_page(info.name, list(found.events))

    # --- subscriptions -----------------------------------------------------------------------

    async def subscriptions(self, request: Request, caller: Caller) -> Response:
        only = request.query_params.get("stream", "").strip()
        names = [only] if only else [s.name for s in self.service.list_streams(caller)]
        rows = []
        for stream in sorted(names):
            for summary in self.service.list_subscriptions(caller, stream):
                detail = await self.service.describe_subscription(caller, stream, summary.name)
                rows.append(_subscription_row(detail))
        return render("subscriptions.html", request, rows=rows, stream=only)

    async def subscription(self, request: Request, caller: Caller) -> Response:
        stream, name = _required(request, "stream"), _required(request, "name")
        detail = await self.service.describe_subscription(caller, stream, name)
        return render(
            "subscription.html",
            request,
            row=_subscription_row(detail),
            detail=detail,
            done=request.query_params.get("done", ""),
        )

    async def reset_subscription(self, request: Request, caller: Caller) -> Response:
        form = await _form(request)
        stream, name = str(form.get("stream", "")), str(form.get("name", ""))
        at = str(form.get("at", "latest"))
        if not stream or not name:
            raise InvalidArgument("a reset names its stream and subscription")
        timestamp_ms = None
        if at == "time":
            timestamp_ms = parse_time(str(form.get("time", "")))
        elif at not in ("earliest", "latest"):
            raise InvalidArgument(f"reset to earliest, latest or time, not {at!r}")
        await self.service.reset_subscription(caller, stream, name, at, timestamp_ms)
        query = urlencode({"stream": stream, "name": name, "done": f"reset to {at}"})
        return RedirectResponse(f"/subscription?{query}", status_code=303)

    # --- Spark queries that write through the slipstream sink --------------------------------

    async def spark_queries(self, request: Request, caller: Caller) -> Response:
        """Every streaming query writing through the sink: it commits each batch under the
        transactional id ``spark:<query id>`` with ``{"query", "batch", "events"}`` as the
        commit's metadata (spark/_sink.py). Per query: its last committed batch, its events,
        when, and a rate between the last two commits seen; ``?query=`` shows one (404 when
        it never committed). Below, the subscriptions queries read through, with their lag."""
        listing = self._spark_listing(request, caller)
        if listing["query"] and not listing["rows"]:
            query = listing["query"]
            listing["missing"] = (
                f"no batch of query {query} was committed through the slipstream sink "
                f"(transactional id spark:{query})"
            )
            return render("spark.html", request, status=404, subscriptions=[], **listing)
        return render(
            "spark.html",
            request,
            subscriptions=await self._spark_subscriptions(caller),
            **listing,
        )

    async def spark_rows(self, request: Request, caller: Caller) -> Response:
        return render("_spark_rows.html", request, **self._spark_listing(request, caller))

    def _spark_listing(self, request: Request, caller: Caller) -> dict[str, Any]:
        query = request.query_params.get("query", "").strip()
        prefix = f"spark:{query}" if query else "spark:"
        rows = []
        for identity in self.service.list_identities(caller, prefix):
            if query and identity.transactional_id != prefix:
                continue
            row = _spark_row(identity)
            if row is None:
                continue
            if isinstance(row["batch"], int) and isinstance(row["events"], int):
                commit = Commit(row["batch"], row["events"], identity.committed_ms)
                self.commits.observe(identity.transactional_id, commit)
            row["rate"] = self.commits.rate(identity.transactional_id)
            rows.append(row)
        return {"query": query, "rows": rows}

    async def _spark_subscriptions(self, caller: Caller) -> list[dict[str, Any]]:
        """Subscriptions with committed positions and no live member: how a query that
        reads with ``.option("subscription", ...)`` records its progress (a stopped
        application's subscription looks the same)."""
        rows = []
        for info in sorted(self.service.list_streams(caller), key=lambda s: s.name):
            for summary in self.service.list_subscriptions(caller, info.name):
                if summary.members or summary.mode != "ordered":
                    continue
                detail = await self.service.describe_subscription(caller, info.name, summary.name)
                if not detail.members:
                    rows.append(_subscription_row(detail))
        return rows

    # --- transactions ------------------------------------------------------------------------

    async def transactions(self, request: Request, caller: Caller) -> Response:
        txns = sorted(self.service.list_txns(caller), key=lambda t: t.txn_id)
        return render(
            "transactions.html", request, txns=txns, done=request.query_params.get("done", "")
        )

    async def abort_transaction(self, request: Request, caller: Caller) -> Response:
        form = await _form(request)
        try:
            txn_id = int(str(form.get("txn_id", "")))
        except ValueError:
            raise InvalidArgument("abort names a transaction id (a number)") from None
        ended = await self.service.end_txn(caller, txn_id, False, operator=True)
        outcome = "committed (it had ended before the abort)" if ended.committed else "aborted"
        query = urlencode({"done": f"transaction {txn_id} {outcome}"})
        return RedirectResponse(f"/transactions?{query}", status_code=303)


# --- helpers -----------------------------------------------------------------------------------


def render(template: str, request: Request, status: int = 200, **context: Any) -> HTMLResponse:
    html = _templates.get_template(template).render(
        request=request, version=__version__, path=request.url.path, **context
    )
    return HTMLResponse(html, status_code=status)


def _credentials(request: Request) -> dict[str, str] | None:
    """The console's token: its cookie, else an ``Authorization: Bearer`` header."""
    token = request.cookies.get(TOKEN_COOKIE, "")
    if not token:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        token = token if scheme.lower() == "bearer" else ""
    return {"token": token.strip()} if token.strip() else None


def _next_page(request: Request, given: str | None = None) -> str:
    """Where to go after logging in: a path of this console only (never another site)."""
    target = given if given is not None else request.query_params.get("next", "/")
    if not target.startswith("/") or target.startswith("//") or "\\" in target:
        return "/"
    return target


def _to_login(request: Request) -> Response:
    """Not logged in: to the login form, back to this page after it."""
    target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    location = "/login?" + urlencode({"next": target})
    if request.headers.get("hx-request"):  # an htmx refresh: the whole page must go
        return Response(status_code=401, headers={"HX-Redirect": location})
    return RedirectResponse(location, status_code=303)


def _error_page(request: Request, exc: SlipstreamError) -> HTMLResponse:
    code = getattr(exc, "code", "error")
    if code.endswith("_not_found"):
        status = 404
    elif isinstance(exc, _BAD_REQUEST):
        status = 400
    else:
        status = 409
    return render(
        "error.html", request, status=status, code=code, message=str(exc), not_found=status == 404
    )


async def _form(request: Request) -> dict[str, str]:
    """The fields of a small urlencoded form (what the pages' forms send), first value each;
    a body over ``MAX_FORM_BYTES`` is refused (400), and so is a form posted by a page of
    another site (its ``Origin`` is not this server): another tab must not reset or abort
    through the operator's browser."""
    origin = request.headers.get("origin")
    host = request.headers.get("host", "")
    if origin is not None and urlsplit(origin).netloc != host:
        raise InvalidArgument(
            f"a form posted from {origin} is refused: the console takes forms from its own "
            f"pages (http://{host}) only"
        )
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_FORM_BYTES:
            raise InvalidArgument(f"a form of the console is at most {MAX_FORM_BYTES} bytes")
    fields = parse_qs(body.decode("utf-8", "replace"), keep_blank_values=True)
    return {name: values[0] for name, values in fields.items()}


def _required(request: Request, name: str) -> str:
    value = request.query_params.get(name, "").strip()
    if not value:
        raise InvalidArgument(f"this page needs the query parameter {name!r}")
    return value


def _int(
    request: Request, name: str, default: int, *, minimum: int, maximum: int | None = None
) -> int:
    text = request.query_params.get(name)
    if text is None or text == "":
        return default
    try:
        value = int(text)
    except ValueError:
        raise InvalidArgument(f"{name} is a whole number, not {text!r}") from None
    if value < minimum or (maximum is not None and value > maximum):
        raise InvalidArgument(f"{name} is {minimum} to {maximum or 'any'}, not {value}")
    return value


def parse_time(text: str) -> int:
    """Milliseconds since the epoch from ms digits or an ISO 8601 time (UTC if no zone)."""
    text = text.strip()
    if text.isdigit():
        return int(text)
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise InvalidArgument(
            f"a time is ISO 8601 (2026-11-24T10:00:00Z) or milliseconds, not {text!r}"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return int(when.timestamp() * 1000)


def _stream_row(info: StreamInfo, rates: Any) -> dict[str, Any]:
    open_segments = [s for s in info.segments if not s.sealed]
    return {
        "info": info,
        "open": len(open_segments),
        "segments": len(info.segments),
        "events": sum(s.end_offset - s.start_offset for s in info.segments),
        "bytes": sum(s.bytes for s in info.segments),
        "produce": rates.produce,
        "consume": rates.consume,
        "last_ms": max((s.last_timestamp or 0 for s in info.segments), default=0),
    }


def _spark_row(identity: IdentityInfo) -> dict[str, Any] | None:
    """What the sink stored with a query's last commit; None for an id that never
    committed (the sink began a transaction and failed before its first commit)."""
    if identity.producer_id < 0 or not identity.last_metadata:
        return None
    try:
        metadata = msgspec.json.decode(identity.last_metadata)
    except msgspec.DecodeError:
        metadata = {}
    if not isinstance(metadata, dict):
        metadata = {}
    batch, events = metadata.get("batch"), metadata.get("events")
    return {
        "query": identity.transactional_id.removeprefix("spark:"),
        "batch": batch if isinstance(batch, int) else None,
        "events": events if isinstance(events, int) else None,
        "committed_ms": identity.committed_ms,
        "age_s": max(0.0, time.time() - identity.committed_ms / 1000),
        "txn_id": identity.last_txn_id,
        "epoch": identity.epoch,
        "rate": None,
    }


def _subscription_row(detail: SubscriptionInfo) -> dict[str, Any]:
    return {
        "detail": detail,
        "lag_events": sum(s.backlog_events for s in detail.segments),
        "lag_ms": max((s.lag_ms for s in detail.segments), default=0),
        "members": detail.members,
    }


def _page_links(page: EventPage) -> dict[str, str | None]:
    return {
        "older": format_positions(page.older) if page.older is not None else None,
        "newer": format_positions(page.newer) if page.newer is not None else None,
    }


def _consumed_events(broker: Broker, stream: str) -> int | None:
    """Events delivered to the stream's readers since the broker started (followers, groups,
    queues, Spark), from the broker's ``slipstream_consumed_events`` counter (its
    ``read="consume"`` series: what this console's own browsing reads is ``lookup``); None for
    a broker without metrics. Reads the counter's series without creating one (``labels``
    would), on the loop thread like every other update of it."""
    counter: Any = getattr(getattr(broker, "metrics", None), "consumed_events", None)
    series = getattr(counter, "_metrics", None)
    if series is None:
        return None
    child = series.get((stream, "consume"))
    return 0 if child is None else int(child._value.get())


def _find_available(service: Service) -> bool:
    """Find by key needs the broker's per-segment key index (``Service.find_events``)."""
    return hasattr(service, "find_events")


def _filters(environment: jinja2.Environment) -> None:
    def rate(value: float | None) -> str:
        if value is None:
            return "\u2013"
        return f"{value:,.0f}/s" if value >= 10 else f"{value:.1f}/s"

    def duration(ms: int | None) -> str:
        if ms is None:
            return "forever"
        seconds = ms / 1000
        for unit, span in (("d", 86400), ("h", 3600), ("min", 60)):
            if seconds >= span:
                return f"{seconds / span:g} {unit}"
        return f"{seconds:g} s"

    def when(ms: int | None) -> str:
        if not ms:
            return "\u2013"
        return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ms / 1000))

    def number(value: int) -> str:
        return f"{value:,}"

    environment.filters.update(
        rate=rate, size=human_bytes, duration=duration, when=when, number=number, tojson=_tojson
    )


def _tojson(value: Any) -> str:
    return msgspec.json.encode(value).decode()


_filters(_templates)
