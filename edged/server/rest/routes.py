"""The REST adapter's route table: Open Inference Protocol REST (and the task, knowledge and
admin APIs) over the Unix socket, with aiohttp. Each route is an endpoint method
(``rest.endpoints``); every request goes through ``rest.middleware.guard``."""

from __future__ import annotations

from aiohttp import web

from edged.admin import Admin
from edged.common.live import Live
from edged.config import ServerConfig
from edged.dataplane.plane import DataPlane
from edged.server.access import Access
from edged.server.rest import endpoints as ep
from edged.server.rest.io import ACCESS, PLANE, SETTINGS
from edged.server.rest.middleware import guard
from edged.server.services import Services

MODEL, VERSIONED = "/v2/models/{model}", "/v2/models/{model}/versions/{version}"
REGION = "/v2/systemsharedmemory/region/{region}"


def create_app(
    plane: DataPlane,
    settings: Live[ServerConfig],
    admin: Admin | None = None,
    access: Access | None = None,
    services: Services | None = None,
) -> web.Application:
    """The aiohttp application with every route (/v1/admin with ``admin``, /v1/kb and /v1/tasks
    with ``services``); ``access`` checks the callers (by default over ``settings``, the server
    settings as a reload leaves them)."""
    services = services if services is not None else Services(plane.check_ready)
    app = web.Application(middlewares=[guard], client_max_size=settings.now().max_request_bytes)
    app[PLANE], app[SETTINGS] = plane, settings
    app[ACCESS] = access if access is not None else Access(settings)
    if admin is not None:
        app.add_routes(ep.AdminEndpoints(admin).routes())
    v2, shm = ep.Inference(plane, settings), ep.SharedMemory(plane)
    daemon, kb = ep.Daemon(plane), ep.Knowledge(plane, services)
    tasks, defaults = ep.Tasks(services), ep.DefaultModels(plane)
    table = [
        web.get("/v2", v2.server_metadata),
        web.get("/v2/health/live", v2.live),
        web.get("/v2/health/ready", v2.ready),
        web.get("/v2/models/stats", v2.statistics),  # before /v2/models/{model}
        web.get("/v2/systemsharedmemory/status", shm.status),
        web.get(REGION + "/status", shm.status),
        web.post(REGION + "/register", shm.register),
        web.post(REGION + "/unregister", shm.unregister),
        web.post("/v2/systemsharedmemory/unregister", shm.unregister),
        web.route("*", "/v2/cudasharedmemory{rest:.*}", shm.cuda),
        *(web.get(path + "/stats", v2.statistics) for path in (MODEL, VERSIONED)),
        *(web.get(path, v2.model_metadata) for path in (MODEL, VERSIONED)),
        *(web.get(path + "/ready", v2.model_ready) for path in (MODEL, VERSIONED)),
        *(web.get(path + "/config", v2.model_config) for path in (MODEL, VERSIONED)),
        web.post(MODEL + "/infer", v2.infer),
        web.post(MODEL + "/stream", v2.stream),
        web.post(VERSIONED + "/infer", v2.infer),
        web.post("/v2/repository/index", v2.repository_index),
        web.post("/v2/repository/models/{model}/load", v2.repository_load),
        web.post("/v2/repository/models/{model}/unload", v2.repository_unload),
        web.get("/v1/status", daemon.status),
        web.get("/v1/events", daemon.events),
        web.get("/v1/capabilities", daemon.capabilities),
        web.get("/v1/tasks", tasks.catalog),
        web.post("/v1/tasks", tasks.run),
        web.get("/v1/kb", kb.namespaces),
        web.post("/v1/kb/{ns}/ingest", kb.ingest),
        web.post("/v1/kb/{ns}/search", kb.search),
        web.post("/v1/kb/{ns}/ask", kb.ask),
        web.get("/v1/kb/{ns}/stats", kb.stats),
        web.post("/v1/kb/{ns}/delete", kb.delete),
        web.get("/metrics", ep.metrics_handler(plane.manager.metrics)),
        web.post("/v1/embed", defaults.embed),
        web.post("/v1/intent", defaults.intent),
        web.post("/v1/ocr", defaults.ocr),
        web.post("/v1/vad", defaults.vad),
    ]
    app.add_routes(table)
    return app
