"""The gateway's domain core: request handling (core), validation and text (text), chat templates
(chat), the OpenAI API's pure parts (openai) and bearer checks (auth). Imports no gRPC; the gRPC and
HTTP fronts are services/gateway."""
