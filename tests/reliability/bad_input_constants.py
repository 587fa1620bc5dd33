"""What the bad-input corpus's requests share: the server's key, a minimal chat, the routes."""

KEY = "bad-input-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MSG = [{"role": "user", "content": "Hi"}]
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
JSON = {"content-type": "application/json"}
