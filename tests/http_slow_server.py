"""A tiny server for the SIGTERM test (run as a subprocess): GET /slow?s=SECONDS sleeps, then answers 200.

Prints "serving on URL" once bound; exits 0 after SIGTERM once in-flight requests have finished."""

import sys
import time

from jaxscale.infra.http_server import Response, Route, ServerConfig, Service, serve_until_signal


def slow(request):
    time.sleep(float(request.query.get("s", "1")))
    return Response.json({"slept": float(request.query.get("s", "1"))})


if __name__ == "__main__":
    service = Service(
        [Route("GET", "/slow", slow)],
        ServerConfig(shutdown_timeout_s=float(sys.argv[1])),
        name="slow",
        metrics_prefix="slow",
    )
    serve_until_signal(service, lambda url: print(f"serving on {url}", flush=True))
    print("stopped", flush=True)
