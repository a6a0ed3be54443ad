"""The S3 probe names the missing feature when a server fails conditional writes with 500."""

from __future__ import annotations

import dataclasses

import pytest

from shared.errors import StoreIncompatible
from shared.store import S3Config, S3Store
from tests.helpers.moto_server import failing_conditions_proxy


async def test_500_on_conditional_put_names_the_feature(
    moto_endpoint: str, s3_config: S3Config
) -> None:
    with failing_conditions_proxy(moto_endpoint) as url:
        config = dataclasses.replace(s3_config, endpoint_url=url)
        with pytest.raises(StoreIncompatible) as info:
            await S3Store.open(config)
    message = str(info.value)
    assert "500" in message and "If-None-Match" in message, message
    assert "conditional writes" in message and f"s3://{config.bucket}/" in message
