"""The HTTP door (DESIGN sections 8, 9 and 14): the job API, the pollers' endpoints and the
operator's console, an ASGI app on hypercorn's trio server in the controller's own loop.

- `codec.py`: pure: request bodies and query parameters in, job objects out, errors as values.
- `shell.py`: the job API's routes and its server (`HttpDoor`), on the job desk.
- `pollers.py`: `GET /ping/`, the leases, and a poller's reports, on the core's poller kind.
- `queues.py`: what each queue holds now, for `GET /queue/` and the console.
- `asgi.py`: the request, the responses and the router.
- `access.py`: who may ask: `allowed_clients`, bearer tokens, and addresses that guess them.
- `connections.py`: accepting, counting and closing connections; HTTP/1.1 only.
- `keepalive.py`: one idle timer task per connection in place of hypercorn's.
- `openapi.py`: the OpenAPI document `GET /openapi.json` answers.
- `console/`: the operator's console.
"""
