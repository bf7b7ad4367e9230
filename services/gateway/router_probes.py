"""What routers in front of several fleets ask a worker, on the gateway's HTTP port.

A fleet is one worker to vllm-router, sglang's router or llm-d's endpoint picker; they probe:

- GET /health (openai_api.py) and /health_generate (sglang's name): 200 while the fleet can serve.
- GET /v1/models (openai_api.py): the served model id.
- GET /get_model_info, /get_server_info (sglang): the model and the worker's shape (one data-parallel
  rank: the fleet is one engine to a router, its shards are behind the scheduler).
- GET /get_load (sglang, vllm-router's power-of-two policy): [{dp_rank, num_reqs,
  num_waiting_reqs, num_tokens}], the routers sum `num_tokens`.
- GET /metrics: the Prometheus text, here too (llm-d scrapes the serving port), with the Model
  Server Protocol gauges (services/gateway/metrics.py `export_fleet_load`).

The load is the scheduler's, through services/gateway/fleet_load.py.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from fastdecode.gateway.core import GatewayCore
from services.gateway.fleet_load import FleetWatch, fleet_watch


class RouterProbes:
    def __init__(self, core: GatewayCore) -> None:
        self.core = core

    @property
    def watch(self) -> FleetWatch:
        return fleet_watch(self.core)  # the one serve() polls with

    async def health_generate(self) -> Response:
        reason = self.core.not_ready_reason()
        if reason is None:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)

    def _model(self) -> dict[str, Any]:
        return {
            "model_path": str(self.core.settings.model),
            "tokenizer_path": str(self.core.settings.model),
            "served_model_name": self.core.model_id,
            "is_generation": True,
            "max_model_len": self.core.limits.max_context,
        }

    async def get_model_info(self) -> Response:
        return JSONResponse(self._model())

    async def get_server_info(self) -> Response:
        load = await self.watch.fresh()
        return JSONResponse(
            {
                **self._model(),
                "model_type": self.core.config.model_type,
                "dp_size": 1,  # the fleet is one engine to a router
                "tp_size": 1,
                "context_length": self.core.limits.max_context,
                "max_total_num_tokens": load.kv_capacity,
                "server": "fastdecode",
            }
        )

    async def get_load(self) -> Response:
        load = await self.watch.fresh()
        entry = {
            "dp_rank": 0,
            "num_reqs": load.running + load.waiting,
            "num_waiting_reqs": load.waiting,
            "num_tokens": load.kv_tokens,
        }
        return JSONResponse([entry])

    async def metrics(self) -> Response:
        await self.watch.fresh()
        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)


def register_router_probes(app: FastAPI, core: GatewayCore) -> None:
    """Add the routers' probes to the gateway's HTTP app (no bearer token: none is under /v1/)."""
    probes = RouterProbes(core)
    for path, handler in (
        ("/health_generate", probes.health_generate),
        ("/get_model_info", probes.get_model_info),
        ("/get_server_info", probes.get_server_info),
        ("/get_load", probes.get_load),
        ("/metrics", probes.metrics),
    ):
        app.add_api_route(path, handler, methods=["GET"])
