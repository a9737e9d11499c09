"""A broker process that serves the console beside the binary protocol, for the console's
tests while the broker's own HTTP server (slipstream/http) is not there yet:
``python devserve.py DATA_DIR PORT HTTP_PORT``. The same Broker, routes mounted on a
Starlette app served by uvicorn on the broker's event loop."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import uvicorn
from starlette.applications import Starlette

from slipstream.broker import Broker, BrokerConfig
from slipstream.console import routes


async def main(data_dir: str, port: int, http_port: int) -> None:
    broker = Broker(BrokerConfig(data_dir=Path(data_dir), port=port))
    async with asyncio.TaskGroup() as group:

        def ready(address: tuple[str, int]) -> None:
            app = Starlette(routes=routes(broker))
            config = uvicorn.Config(app, host="127.0.0.1", port=http_port, log_level="warning")
            group.create_task(uvicorn.Server(config).serve())

        await broker.serve(ready)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
