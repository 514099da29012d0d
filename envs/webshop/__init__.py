"""WebShop, the RAGEN paper's fourth environment: a shop to search, browse and buy in.

The environment is :class:`~envs.webshop.env.WebShopEnv` (pages, actions, reward, render); its shop
(:mod:`~envs.webshop.shop`) serves a generated catalogue (:mod:`~envs.webshop.catalogue`) or
WebShop's original files (:mod:`~envs.webshop.loader`), searched with BM25
(:mod:`~envs.webshop.search`). See docs/environments.md, "WebShop".
"""

from envs.webshop.env import WebShopEnv

__all__ = ["WebShopEnv"]
