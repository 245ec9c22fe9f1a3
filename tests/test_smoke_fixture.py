from tests.helpers import run_py


def test_child_sees_parent_bytes(make_pool):
    p = make_pool("1M", block_size="4K")
    p.put("k", b"hello")
    out = run_py(f"""
        from cortex_cache import Pool
        with Pool.open({p.name!r}) as q:
            print(q.get("k").decode())
    """)
    assert out.stdout.decode().strip() == "hello"
