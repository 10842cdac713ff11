"""The HTTP front end: the OpenAI and Anthropic APIs as a second door onto the same request path.

server.py (HTTP/1.1 on the event loop) → routes.py (endpoint, method, content type, API key) →
openai.py / anthropic.py (JSON → Request, and the Reply that writes the answer) → door.py
(the request path's callbacks as SSE events or one JSON body). errors.py maps error codes to
statuses and bodies. docs/http.md describes the endpoints.
"""
