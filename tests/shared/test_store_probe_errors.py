"""S3 answers an operator must act on: a probe 500 names the missing feature; a missing
bucket or refused credentials are FAILED_PRECONDITION naming the cause."""

from __future__ import annotations

import dataclasses

import grpc
import pytest
from botocore.exceptions import ClientError

from shared.errors import StoreIncompatible, StoreMisconfigured
from shared.rpc import status_for
from shared.store import S3Config, S3Store
from shared.store.s3 import _translate
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


@pytest.mark.parametrize(
    ("code", "status", "cause"),
    [
        ("NoSuchBucket", 404, "the bucket does not exist"),
        ("InvalidAccessKeyId", 403, "the access key is not known"),
        ("SignatureDoesNotMatch", 403, "the secret key is wrong"),
        ("AccessDenied", 403, "access denied"),
    ],
)
def test_misconfiguration_is_failed_precondition_with_its_cause(
    code: str, status: int, cause: str
) -> None:
    error = ClientError(
        {"Error": {"Code": code, "Message": "x"}, "ResponseMetadata": {"HTTPStatusCode": status}},
        "GetObject",
    )
    mapped = _translate(error, "get", "accounts/a.json")
    assert isinstance(mapped, StoreMisconfigured) and cause in str(mapped), mapped
    assert status_for(mapped) == grpc.StatusCode.FAILED_PRECONDITION
