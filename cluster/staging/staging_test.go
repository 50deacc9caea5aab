package staging_test

import (
	"bytes"
	"context"
	"errors"
	"math/rand/v2"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc/cluster/staging"
)

// hostEnds is a pipeline over host memory with uneven stage times: a slot
// reused before its chunk left the last stage would corrupt the copy.
func hostEnds(src, dst []byte, l staging.Layout, active, peak *atomic.Int32) staging.Ends {
	ringA, ringB := make([]byte, int64(l.Depth)*l.Chunk), make([]byte, int64(l.Depth)*l.Chunk)
	work := func(d time.Duration, f func()) {
		n := active.Add(1)
		for p := peak.Load(); n > p && !peak.CompareAndSwap(p, n); p = peak.Load() {
		}
		time.Sleep(time.Duration(rand.Int64N(int64(d))))
		f()
		active.Add(-1)
	}
	return staging.Ends{
		Out: func(ctx context.Context, off, n, slot int64) error {
			work(200*time.Microsecond, func() { copy(ringA[slot:slot+n], src[off:off+n]) })
			return nil
		},
		Wire: func(ctx context.Context, off, n, slot int64) error {
			work(time.Millisecond, func() { copy(ringB[slot:slot+n], ringA[slot:slot+n]) })
			return nil
		},
		In: func(ctx context.Context, off, n, slot int64) error {
			work(500*time.Microsecond, func() { copy(dst[off:off+n], ringB[slot:slot+n]) })
			return nil
		},
	}
}

func TestCopy(t *testing.T) {
	for _, l := range []staging.Layout{
		{Size: 1<<20 + 12345, Chunk: 64 << 10, Depth: 4},
		{Size: 1 << 20, Chunk: 1 << 20, Depth: 1},
		{Size: 100, Chunk: 7, Depth: 3},
		{Size: 0, Chunk: 7, Depth: 3},
	} {
		src := make([]byte, l.Size)
		rand.NewChaCha8([32]byte{1}).Read(src)
		dst := make([]byte, l.Size)
		var active, peak atomic.Int32
		if err := staging.Copy(context.Background(), l, hostEnds(src, dst, l, &active, &peak)); err != nil {
			t.Fatalf("%+v: %v", l, err)
		}
		if !bytes.Equal(dst, src) {
			t.Fatalf("%+v: the copy differs", l)
		}
		if l.Depth > 1 && l.Chunks() > 4 && peak.Load() < 2 {
			t.Errorf("%+v: the stages never overlapped", l)
		}
		t.Logf("%+v: %d chunks, at most %d stages at once", l, l.Chunks(), peak.Load())
	}
}

func TestRunErrors(t *testing.T) {
	boom := errors.New("boom")
	var seen atomic.Int32
	err := staging.Run(context.Background(), 100, 4,
		func(ctx context.Context, i int) error { return nil },
		func(ctx context.Context, i int) error {
			if i == 5 {
				return boom
			}
			return nil
		},
		func(ctx context.Context, i int) error { seen.Add(1); return nil })
	if !errors.Is(err, boom) || !strings.Contains(err.Error(), "stage 1, chunk 5") {
		t.Fatalf("a failing stage: %v", err)
	}
	if seen.Load() > 5 {
		t.Fatalf("the last stage saw %d chunks after chunk 5 failed", seen.Load())
	}
	// The caller's ctx ends a stalled pipeline.
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	err = staging.Run(ctx, 10, 2, func(ctx context.Context, i int) error {
		<-ctx.Done()
		return ctx.Err()
	})
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("a stalled stage: %v", err)
	}
	for _, bad := range []struct{ chunks, depth int }{{-1, 1}, {1, 0}} {
		if err := staging.Run(context.Background(), bad.chunks, bad.depth, func(context.Context, int) error { return nil }); err == nil {
			t.Errorf("%+v accepted", bad)
		}
	}
	if err := staging.Copy(context.Background(), staging.Layout{Size: 10, Chunk: 0, Depth: 1}, staging.Ends{}); err == nil {
		t.Error("a zero chunk accepted")
	}
}
