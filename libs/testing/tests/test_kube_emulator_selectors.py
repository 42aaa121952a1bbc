"""Label and field selectors: parsing, and filtering lists through the real client."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes_asyncio.client import ApiException

from turnstile_testing.kube_emulator import ApiError, KubeEmulator, LabelSelector
from turnstile_testing.kube_emulator import pod_manifest as pod_body

PODS = {
    "web-1": {"app": "web", "tier": "front", "size": "5"},
    "web-2": {"app": "web", "size": "2"},
    "db-1": {"app": "db", "tier": "back"},
    "bare": {},
}


@pytest.fixture
async def seeded(kube: KubeEmulator) -> KubeEmulator:
    for name, labels in PODS.items():
        kube.create_pod("ns", pod_body(name, labels))
    return kube


@pytest.mark.parametrize(
    ("selector", "expected"),
    [
        ("app=web", {"web-1", "web-2"}),
        ("app==web", {"web-1", "web-2"}),
        ("app!=web", {"db-1", "bare"}),
        ("app in (web, db)", {"web-1", "web-2", "db-1"}),
        ("app notin (web)", {"db-1", "bare"}),
        ("tier", {"web-1", "db-1"}),
        ("!tier", {"web-2", "bare"}),
        ("app=web,tier", {"web-1"}),
        ("app in (web),!tier", {"web-2"}),
        ("size>3", {"web-1"}),
        ("size<3", {"web-2"}),
        ("", {"web-1", "web-2", "db-1", "bare"}),
    ],
)
async def test_list_filters_by_label_selector(
    seeded: KubeEmulator, v1: Any, selector: str, expected: set[str]
) -> None:
    listed = await v1.list_namespaced_pod("ns", label_selector=selector)

    assert {p.metadata.name for p in listed.items} == expected


async def test_field_selectors_cover_name_namespace_node_and_phase(
    seeded: KubeEmulator, v1: Any
) -> None:
    seeded.create_pod("other", pod_body("web-1"))
    seeded.set_node_name("ns", "web-1", "node-a")
    seeded.set_pod_phase("ns", "web-1", "Running")

    async def names(**kwargs: str) -> set[tuple[str, str]]:
        listed = await v1.list_pod_for_all_namespaces(**kwargs)
        return {(p.metadata.namespace, p.metadata.name) for p in listed.items}

    assert await names(field_selector="metadata.name=web-1") == {
        ("ns", "web-1"),
        ("other", "web-1"),
    }
    assert await names(field_selector="metadata.namespace=other") == {("other", "web-1")}
    assert await names(field_selector="spec.nodeName=node-a") == {("ns", "web-1")}
    assert ("ns", "web-1") not in await names(field_selector="spec.nodeName=")
    assert await names(field_selector="status.phase=Running") == {("ns", "web-1")}
    assert await names(field_selector="status.phase!=Pending,metadata.namespace==ns") == {
        ("ns", "web-1")
    }
    assert await names(field_selector="metadata.name=web-1", label_selector="app=web") == {
        ("ns", "web-1")
    }


async def test_bad_selectors_are_400_bad_request(seeded: KubeEmulator, v1: Any) -> None:
    with pytest.raises(ApiException) as bad_label:
        await v1.list_namespaced_pod("ns", label_selector="app in web")
    with pytest.raises(ApiException) as bad_field:
        await v1.list_namespaced_pod("ns", field_selector="spec.image=x")

    assert bad_label.value.status == 400
    assert bad_field.value.status == 400
    assert "field label not supported: spec.image" in str(bad_field.value.body)


@pytest.mark.parametrize(
    "text", ["app in ()", "=web", "app=web,", "app in (a b)", "a/b/c=d", "app=-bad-", "x>y"]
)
def test_malformed_label_selectors_raise(text: str) -> None:
    with pytest.raises(ApiError) as caught:
        LabelSelector.parse(text)
    assert caught.value.code == 400


def test_negative_requirements_match_objects_without_the_key() -> None:
    assert LabelSelector.parse("app!=web").matches({})
    assert LabelSelector.parse("app notin (web)").matches(None)
    assert not LabelSelector.parse("app in (web)").matches({})
    assert LabelSelector.parse(" example.com/app = web ").matches({"example.com/app": "web"})
