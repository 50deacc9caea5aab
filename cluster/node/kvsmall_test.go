package node_test

import (
	"bytes"
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc/client"
	"github.com/cudaipc/cudaipc/cluster/internal/etcdtest"
	"github.com/cudaipc/cudaipc/cluster/node"
	"github.com/cudaipc/cudaipc/kv"
)

// TestKVSmallReadsInFlight: many one-block reads of another node's space
// in flight from one client. Each lands its own block; those of a space
// gone fail alone, naming their block; reads canceled in flight end, and
// the rest go on; more than a connection's kv_read bound at once end each
// with its bytes or LIMIT, none left waiting; the daemons batch what
// waits.
func TestKVSmallReadsInFlight(t *testing.T) {
	const blocks, bsize = 2048, 512
	srv := etcdtest.Start(t)
	a := startDaemon(t, srv, "a")
	b := startDaemon(t, srv, "b")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	layout := kv.Layout{Blocks: blocks, Layers: [][]kv.Part{{{Region: 0, Stride: bsize, Bytes: bsize}}}}
	src := newHostSpace(t, layout, []int64{blocks * bsize}, 31)
	sp, err := kv.Register(ctx, a.c, "small/src", src.local, client.RegisterOptions{})
	if err != nil {
		t.Fatal(err)
	}
	gone := newHostSpace(t, layout, []int64{blocks * bsize}, 32)
	gsp, err := kv.Register(ctx, a.c, "small/gone", gone.local, client.RegisterOptions{})
	if err != nil {
		t.Fatal(err)
	}
	goneDesc := gsp.Desc()
	if err := gsp.Close(ctx); err != nil {
		t.Fatal(err)
	}
	dst := newHostSpace(t, layout, []int64{blocks * bsize}, 0)
	if _, err := kv.Register(ctx, b.c, "small/dst", dst.local, client.RegisterOptions{}); err != nil {
		t.Fatal(err)
	}
	read := func(ctx context.Context, from *kv.Desc, s, d int) error {
		tr, err := kv.ReadBlocks(ctx, b.c, kv.Request{Src: from, SrcBlocks: []int{s}, Dst: dst.local, DstBlocks: []int{d}})
		if err != nil {
			return err
		}
		return tr.Wait(ctx)
	}
	// Reads at once, one in 9 of a space gone.
	const n = 1000
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		from := sp.Desc()
		if i%9 == 4 {
			from = goneDesc
		}
		wg.Go(func() { errs[i] = read(ctx, from, blocks-1-i, i) })
	}
	wg.Wait()
	var ok, srcIDs []int
	for i, err := range errs {
		if i%9 == 4 {
			var be *kv.BlockError
			if !errors.As(err, &be) || !errors.Is(err, client.ErrNotFound) || len(be.Blocks) != 1 || be.Blocks[0] != i {
				t.Fatalf("read %d of a space gone: %v", i, err)
			}
			continue
		}
		if err != nil {
			t.Fatalf("read %d: %v", i, err)
		}
		ok, srcIDs = append(ok, i), append(srcIDs, blocks-1-i)
	}
	checkRead(t, src, dst, make2(dst), srcIDs, ok, 0, 1)
	if node.KVBatches(a.node) == 0 {
		t.Log("no batch of small reads this time: the reads never waited for a request under way")
	}

	// Canceled in flight: every one ends, and the daemons go on.
	cctx, ccancel := context.WithCancel(ctx)
	cerrs := make([]error, 300)
	for i := range cerrs {
		wg.Go(func() { cerrs[i] = read(cctx, sp.Desc(), i, i) })
	}
	time.Sleep(time.Millisecond)
	ccancel()
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("reads canceled in flight did not end within 30s")
	}
	for i, err := range cerrs {
		if err != nil && !errors.Is(err, context.Canceled) {
			t.Fatalf("canceled read %d: %v", i, err)
		}
	}
	if err := read(ctx, sp.Desc(), 7, 7); err != nil {
		t.Fatalf("a read after the cancels: %v", err)
	}

	// More than a connection's kv_reads at once: each ends, with its
	// bytes or LIMIT.
	const many = 3000
	merrs := make([]error, many)
	for i := range many {
		wg.Go(func() { merrs[i] = read(ctx, sp.Desc(), i%blocks, i%blocks) })
	}
	wg.Wait()
	limited := 0
	for i, err := range merrs {
		switch {
		case err == nil:
			d := i % blocks
			if !bytes.Equal(kvBlock(dst.local.Layout, 0, 0, d, dst.region), kvBlock(src.local.Layout, 0, 0, d, src.region)) {
				t.Fatalf("read %d of %d at once: block %d holds other bytes", i, many, d)
			}
		case errors.Is(err, client.ErrLimit):
			limited++
		default:
			t.Fatalf("read %d of %d at once: %v", i, many, err)
		}
	}
	t.Logf("%d of %d reads at once refused (LIMIT)", limited, many)
	if limited == many {
		t.Fatal("every read refused")
	}
	if err := read(ctx, sp.Desc(), 9, 9); err != nil {
		t.Fatalf("a read after the burst: %v", err)
	}
}
