/*
 * The DPDK side of the peers comparison: each function runs a loop of
 * `iters` iterations of one DPDK operation, so the Rust timing harness
 * times DPDK and pfrag alike, with the per-call cost of the FFI spread
 * over the whole loop. Returns a value built from every object touched,
 * so that the compiler keeps the loop.
 */
#include <stdint.h>

#include <rte_eal.h>
#include <rte_lcore.h>
#include <rte_mbuf.h>
#include <rte_mempool.h>

#define PEERS_BURST_MAX 64

int peers_eal_init(int argc, char **argv) { return rte_eal_init(argc, argv); }

void peers_eal_cleanup(void) { rte_eal_cleanup(); }

unsigned peers_lcore_id(void) { return rte_lcore_id(); }

struct rte_mempool *peers_mempool_create(unsigned n, unsigned elt_size, unsigned cache)
{
    return rte_mempool_create("peers_mp", n, elt_size, cache, 0, NULL, NULL, NULL, NULL,
                              SOCKET_ID_ANY, 0);
}

struct rte_mempool *peers_pktmbuf_pool_create(unsigned n, unsigned cache)
{
    return rte_pktmbuf_pool_create("peers_mbuf", n, cache, 0, RTE_MBUF_DEFAULT_BUF_SIZE,
                                   SOCKET_ID_ANY);
}

/* One object out and back: rte_mempool_get + rte_mempool_put. */
int64_t peers_mempool_single(struct rte_mempool *mp, uint64_t iters)
{
    uintptr_t sink = 0;
    for (uint64_t i = 0; i < iters; i++) {
        void *o;
        if (rte_mempool_get(mp, &o) != 0)
            return -1;
        sink ^= (uintptr_t)o;
        rte_mempool_put(mp, o);
    }
    return (int64_t)(sink & 0x7fffffff);
}

/* `burst` objects out and back: rte_mempool_get_bulk + put_bulk. */
int64_t peers_mempool_bulk(struct rte_mempool *mp, uint64_t iters, unsigned burst)
{
    void *objs[PEERS_BURST_MAX];
    uintptr_t sink = 0;
    if (burst > PEERS_BURST_MAX)
        return -1;
    for (uint64_t i = 0; i < iters; i++) {
        if (rte_mempool_get_bulk(mp, objs, burst) != 0)
            return -1;
        sink ^= (uintptr_t)objs[burst - 1];
        rte_mempool_put_bulk(mp, objs, burst);
    }
    return (int64_t)(sink & 0x7fffffff);
}

/* One packet buffer out and back: rte_pktmbuf_alloc + rte_pktmbuf_free
 * (which also resets the mbuf's header fields). */
int64_t peers_pktmbuf_single(struct rte_mempool *mp, uint64_t iters)
{
    uintptr_t sink = 0;
    for (uint64_t i = 0; i < iters; i++) {
        struct rte_mbuf *m = rte_pktmbuf_alloc(mp);
        if (m == NULL)
            return -1;
        sink ^= (uintptr_t)rte_pktmbuf_iova(m);
        rte_pktmbuf_free(m);
    }
    return (int64_t)(sink & 0x7fffffff);
}

/* `burst` packet buffers: rte_pktmbuf_alloc_bulk + rte_pktmbuf_free_bulk. */
int64_t peers_pktmbuf_bulk(struct rte_mempool *mp, uint64_t iters, unsigned burst)
{
    struct rte_mbuf *ms[PEERS_BURST_MAX];
    uintptr_t sink = 0;
    if (burst > PEERS_BURST_MAX)
        return -1;
    for (uint64_t i = 0; i < iters; i++) {
        if (rte_pktmbuf_alloc_bulk(mp, ms, burst) != 0)
            return -1;
        sink ^= (uintptr_t)rte_pktmbuf_iova(ms[burst - 1]);
        rte_pktmbuf_free_bulk(ms, burst);
    }
    return (int64_t)(sink & 0x7fffffff);
}
