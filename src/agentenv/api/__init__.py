"""The E2B contract, once: the route table (routes.py), the OpenAPI document generated from it
(openapi.py), the request and response models, errors, paging, teams and credentials. The node
(agentenv.node) and the gateway (agentenv.control.gateway) both serve from it; it imports
neither (docs/architecture.md §3)."""
