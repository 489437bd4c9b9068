"""Tenants, the admin's: POST/GET /api/tenants, GET/DELETE /api/tenants/{name}.

The admin (the serve token) only; a tenant's token gets 403. Scoping of
everything else by tenant is in the service (core/service.py): these handlers,
like the others, pass the caller along.
"""

from __future__ import annotations

from ..core.tenants import TenantCreate
from .base import APIHandler


class TenantsHandler(APIHandler):
    async def get(self):
        self.reply(await self.service.list_tenants(self.who))

    async def post(self):
        body = self.body(TenantCreate)
        created = await self.service.create_tenant(body, self.who)
        self.set_header("Location", f"/api/tenants/{created['name']}")
        self.set_header("Cache-Control", "no-store")  # the token is in it, once
        self.reply(created, 201)


class TenantHandler(APIHandler):
    async def get(self, name):
        self.reply(await self.service.get_tenant(name, self.who))

    async def delete(self, name):
        self.reply(await self.service.delete_tenant(name, self.who))


def routes() -> list:
    return [
        (r"/api/tenants/?", TenantsHandler),
        (r"/api/tenants/([^/]+)/?", TenantHandler),
    ]
