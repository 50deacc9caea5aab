package node

import (
	"bytes"
	"context"
	"errors"
	"os"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc/cluster"
	"github.com/cudaipc/cudaipc/cluster/etcddir"
	"github.com/cudaipc/cudaipc/cluster/internal/etcdtest"
	"github.com/cudaipc/cudaipc/cluster/ucxtransport"
	"github.com/cudaipc/cudaipc/internal/testutil"
	"github.com/cudaipc/cudaipc/transport/ucx"
)

// fillingNode starts a node of cfg whose pinned buffers are host memory
// (fillings without a GPU), and a UCX transport to read its exposures.
func fillingNode(t *testing.T, cfg Config) (*Node, *ucxtransport.Transport) {
	t.Helper()
	if err := ucx.Available(); err != nil {
		if os.Getenv("CUDAIPC_REQUIRE_UCX") == "1" || os.Getenv(etcdtest.EnvRequire) == "1" {
			t.Fatal(err)
		}
		t.Skip(err)
	}
	srv := etcdtest.Start(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	sec, err := cluster.NewSecret([]byte("filling-test-secret"))
	if err != nil {
		t.Fatal(err)
	}
	cfg.Directory = etcddir.Config{Endpoints: []string{srv.Endpoint()}, Node: "a", Secret: sec,
		TTL: 2 * time.Second, Prefix: "/t/" + t.Name() + "/"}
	cfg.Listen = "127.0.0.1:0"
	n, err := Start(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { n.Close() })
	n.pinned.alloc = (&fakePinned{}).alloc
	reader, err := ucxtransport.NewWith("reader", ucxtransport.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { reader.Close() })
	return n, reader
}

// startFilling lists a filling of incarnation id, size bytes, on n, as
// gpuFilling does, with its buffer registered; the test stages it.
func startFilling(t *testing.T, n *Node, id string, size int64) *filling {
	t.Helper()
	b, err := n.pinned.get(nil, size)
	if err != nil {
		t.Fatal(err)
	}
	if err := n.registerPinned(b); err != nil {
		t.Fatal(err)
	}
	fl := &filling{n: n, id: id, b: b, size: size, done: make(chan struct{}), windows: map[*fillWindow]struct{}{}, users: 1}
	n.mu.Lock()
	n.filling[id] = fl
	n.mu.Unlock()
	return fl
}

// TestFillingExposures drives a filling (a GPU object's pinned copy
// staged behind its published record) without a GPU: a host buffer stands
// for the pinned one, the test for the device→host copy. Two exposures
// taken while it fills are read by another node: their reads wait for the
// slices and end with the right bytes; the buffer goes back to the pool,
// tagged with the incarnation, only after the staging and the last
// exposure ended. A second filling fails mid-way: the read waiting is
// refused, the filling is no longer listed (a later exposure stages the
// object anew), and its buffer goes back untagged.
func TestFillingExposures(t *testing.T) {
	n, reader := fillingNode(t, Config{})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	const size, slice = 6<<20 + 123, 1 << 20
	want := testutil.RandomBytes(1931, size)
	start := func(id string) *filling { return startFilling(t, n, id, size) }
	read := func(e cluster.Exposure) <-chan error {
		errc := make(chan error, 1)
		go func() {
			ep, err := reader.Connect(ctx, e.Worker)
			if err != nil {
				errc <- err
				return
			}
			defer ep.Close()
			dst := make([]byte, e.Size)
			if err := ep.Get(ctx, e.RKey, e.Addr, dst); err != nil {
				errc <- err
				return
			}
			if !bytes.Equal(dst, want) {
				errc <- errors.New("the bytes read differ from those staged")
				return
			}
			errc <- nil
		}()
		return errc
	}
	expose := func(id string) (cluster.Exposure, func(), error) {
		fl := n.fillingFor(id)
		if fl == nil {
			return cluster.Exposure{}, nil, errors.New("not filling")
		}
		return n.exposeFilling(fl)
	}

	fl := start("inc-1")
	e1, release1, err := expose("inc-1")
	if err != nil {
		t.Fatal(err)
	}
	r1 := read(e1)
	fill := func(fl *filling, upto int64) {
		for off := int64(0); off < upto; off += slice {
			end := min(off+slice, size)
			copy(fl.b.mem[off:end], want[off:end])
			fl.advance(end)
			if off == 2*slice {
				time.Sleep(20 * time.Millisecond) // the reads catch up and wait
			}
		}
	}
	fill(fl, 3*slice)
	e2, release2, err := expose("inc-1") // a second reader, mid-way
	if err != nil {
		t.Fatal(err)
	}
	r2 := read(e2)
	time.Sleep(20 * time.Millisecond)
	if n.tr.Served().Deferred == 0 {
		t.Fatal("no read waited for the slices not staged")
	}
	fill(fl, size)
	fl.end(nil)
	for i, r := range []<-chan error{r1, r2} {
		if err := testutil.Next(t, r, 20*time.Second); err != nil {
			t.Fatalf("reader %d: %v", i+1, err)
		}
	}
	if n.fillingFor("inc-1") != nil {
		t.Fatal("a staged filling is still listed")
	}
	release1()
	if b := n.pinned.take("inc-1", nil, size); b != nil {
		t.Fatal("the buffer went back while an exposure still read it")
	}
	release2()
	b := n.pinned.take("inc-1", nil, size)
	if b == nil {
		t.Fatal("the staged buffer did not go back tagged with its incarnation")
	}
	n.pinned.put(b)

	// A staging that fails with a read waiting.
	fl = start("inc-2")
	e3, release3, err := expose("inc-2")
	if err != nil {
		t.Fatal(err)
	}
	refused := n.tr.Served().Refused
	r3 := read(e3)
	fill(fl, slice)
	time.Sleep(20 * time.Millisecond)
	fl.end(errors.New("injected copy failure"))
	if err := testutil.Next(t, r3, 20*time.Second); !errors.Is(err, ucx.ErrRefused) {
		t.Fatalf("a read waiting when the staging failed: %v, want ErrRefused", err)
	}
	if n.tr.Served().Refused == refused {
		t.Fatal("the holder refused nothing")
	}
	if n.fillingFor("inc-2") != nil {
		t.Fatal("a failed filling is still listed: later exposures would read it")
	}
	release3()
	if b := n.pinned.take("inc-2", nil, size); b != nil {
		t.Fatal("a failed staging's buffer went back tagged")
	}
}
