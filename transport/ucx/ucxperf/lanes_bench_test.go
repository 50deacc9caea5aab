package ucxperf_test

import (
	"context"
	"encoding/base64"
	"fmt"
	"os"
	"strconv"
	"sync"
	"testing"

	"github.com/cudaipc/cudaipc/internal/testutil"
	"github.com/cudaipc/cudaipc/transport/ucx"
)

// connectLanes starts an arena process of size bytes serving from lanes
// workers and connects one worker of this process to each: an endpoint
// and the arena's key on each lane.
func connectLanes(b *testing.B, size, lanes int) ([]*ucx.Endpoint, []*ucx.RemoteKey) {
	eps, keys, _ := connectLanesToken(b, size, lanes)
	return eps, keys
}

// connectLanesToken is connectLanes that also returns the token of a
// window on the whole arena.
func connectLanesToken(b *testing.B, size, lanes int) ([]*ucx.Endpoint, []*ucx.RemoteKey, ucx.Token) {
	b.Helper()
	if err := ucx.Available(); err != nil {
		b.Skip(err)
	}
	child := testutil.Spawn(b, "arena", "SIZE="+strconv.Itoa(size), "LANES="+strconv.Itoa(lanes))
	var info arenaInfo
	if err := child.Recv(&info); err != nil {
		b.Fatalf("arena: %v\n%s", err, child.Stderr())
	}
	if len(info.Addrs) != lanes {
		b.Fatalf("arena: %d serving workers, want %d", len(info.Addrs), lanes)
	}
	c, err := ucx.NewContext(ucx.ContextOptions{})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { c.Close() })
	var rk ucx.RegionKey
	kb, _ := base64.StdEncoding.DecodeString(info.Key)
	if err := rk.UnmarshalBinary(kb); err != nil {
		b.Fatal(err)
	}
	var eps []*ucx.Endpoint
	var keys []*ucx.RemoteKey
	for _, a := range info.Addrs {
		w, err := c.NewWorker(ucx.WorkerOptions{})
		if err != nil {
			b.Fatal(err)
		}
		var addr ucx.WorkerAddress
		ab, _ := base64.StdEncoding.DecodeString(a)
		if err := addr.UnmarshalBinary(ab); err != nil {
			b.Fatal(err)
		}
		ep, err := w.Connect(addr)
		if err != nil {
			b.Fatal(err)
		}
		key, err := ep.Unpack(rk)
		if err != nil {
			b.Fatal(err)
		}
		eps, keys = append(eps, ep), append(keys, key)
	}
	tb, _ := base64.StdEncoding.DecodeString(info.Token)
	return eps, keys, ucx.Token(tb)
}

// BenchmarkGetLanes pulls 256 MiB from another process over 1, 2, 4, 8
// and 16 lanes: a worker pair and a connection each, every lane reading its share
// of the range (16 MiB reads, two in flight) at once. It is the raw floor
// of a pull between daemons of as many lanes (serve --experimental-cluster-lanes): over
// tcp one connection and one progress thread a side bound a transfer
// below what the link (here the loopback, i.e. the CPUs) carries.
func BenchmarkGetLanes(b *testing.B) {
	chunk, depth := lanesReads(b)
	benchLanes(b, func(ctx context.Context, ep *ucx.Endpoint, key *ucx.RemoteKey, _ ucx.Token, addr uint64, dst []byte) error {
		return ucx.GetWith(ctx, ep, key, addr, dst, ucx.GetOptions{Chunk: chunk, Depth: depth})
	})
}

// lanesReads returns the read size and the reads in flight a lane of the
// lanes benchmarks: 16 MiB and 2, or $UCXPERF_LANES_CHUNK_KIB and
// $UCXPERF_LANES_DEPTH (to compare with a pull's chunks: 4 MiB by default).
func lanesReads(b *testing.B) (chunk, depth int) {
	chunk, depth = 16<<20, 2
	if v := os.Getenv("UCXPERF_LANES_CHUNK_KIB"); v != "" {
		kib, err := strconv.Atoi(v)
		if err != nil || kib < 4 || kib > 1<<20 {
			b.Fatalf("UCXPERF_LANES_CHUNK_KIB=%q: want a whole number of KiB from 4 to 1048576", v)
		}
		chunk = kib << 10
	}
	if v := os.Getenv("UCXPERF_LANES_DEPTH"); v != "" {
		d, err := strconv.Atoi(v)
		if err != nil || d < 1 || d > 256 {
			b.Fatalf("UCXPERF_LANES_DEPTH=%q: want 1 to 256", v)
		}
		depth = d
	}
	return chunk, depth
}

// BenchmarkFetchLanes is BenchmarkGetLanes with ucx.Fetch: the arena
// process sends each lane's share (16 MiB requests, two in flight) by
// UCX's rendezvous protocol, which over tcp writes from its memory into
// the reader's, rather than answering emulated GETs 8 KiB at a time.
func BenchmarkFetchLanes(b *testing.B) {
	chunk, depth := lanesReads(b)
	benchLanes(b, func(ctx context.Context, ep *ucx.Endpoint, key *ucx.RemoteKey, tok ucx.Token, addr uint64, dst []byte) error {
		return ucx.Fetch(ctx, ep, key, addr, dst, ucx.FetchOptions{Chunk: chunk, Depth: depth, Token: tok})
	})
}

// benchLanes reads 256 MiB (or $UCXPERF_LANES_MIB MiB, which a floor
// compared with a transfer of seconds sets larger) with read over 1, 2,
// 4, 8 and 16 lanes at once, each lane its share.
func benchLanes(b *testing.B, read func(ctx context.Context, ep *ucx.Endpoint, key *ucx.RemoteKey, tok ucx.Token, addr uint64, dst []byte) error) {
	size := 256 << 20
	if v := os.Getenv("UCXPERF_LANES_MIB"); v != "" {
		mib, err := strconv.Atoi(v)
		if err != nil || mib < 16 || mib > 64<<10 {
			b.Fatalf("UCXPERF_LANES_MIB=%q: want a whole number of MiB from 16 to 65536", v)
		}
		size = mib << 20
	}
	for _, lanes := range []int{1, 2, 4, 8, 16} {
		b.Run(fmt.Sprintf("lanes=%d", lanes), func(b *testing.B) {
			eps, keys, tok := connectLanesToken(b, size, lanes)
			dst := make([]byte, size)
			ctx := context.Background()
			part := size / lanes
			get := func() error {
				errs := make([]error, lanes)
				var wg sync.WaitGroup
				for i := range lanes {
					wg.Go(func() {
						off := i * part
						errs[i] = read(ctx, eps[i], keys[i], tok, keys[i].Key().Addr+uint64(off), dst[off:off+part])
					})
				}
				wg.Wait()
				for _, err := range errs {
					if err != nil {
						return err
					}
				}
				return nil
			}
			if err := get(); err != nil { // connect, fault dst in
				b.Fatal(err)
			}
			want := testutil.RandomBytes(7, 1<<20)
			if string(dst[:len(want)]) != string(want) {
				b.Fatal("the first MiB read is not the arena's")
			}
			b.SetBytes(int64(size))
			for b.Loop() {
				if err := get(); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
