"""OpenAI's Responses API (`/v1/responses`), served by the chat pipeline through one conversion layer.

`protocol.py` the request and response bodies, `convert.py` request → chat request (and chat errors back),
`output.py` chat answers → output items and Response objects, `events.py` chat chunks → typed stream events,
`store.py` the stored responses (`previous_response_id`, `GET` / `DELETE`), `background.py` background mode
(`background: true`, `cancel`), `prepare.py` a background request's checks before it is queued, `replay.py`
the kept events of a resumable background stream (`GET ?stream=true&starting_after=N`), `route.py` the routes.
"""

from structgen.server.responses.route import add_responses_routes
from structgen.server.responses.store import ResponseStore

__all__ = ["ResponseStore", "add_responses_routes"]
