package cluster_test

import (
	"bytes"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc/bundle"
	"github.com/cudaipc/cudaipc/cluster"
	"github.com/cudaipc/cudaipc/cluster/internal/etcdtest"
	"github.com/cudaipc/cudaipc/cluster/internal/memtransport"
	"github.com/cudaipc/cudaipc/internal/testutil"
)

// A partial read reads only the chunks its ranges touch, and nothing of
// it stays on the reader.
func TestPullRanges(t *testing.T) {
	srv := etcdtest.Start(t)
	nw := memtransport.NewNetwork()
	a, b := startNode(t, srv, nw, "a", secret), startNode(t, srv, nw, "b", secret)
	ctx := bounded(t, 30*time.Second)
	const chunk = 1 << 20
	o, want := a.Put(t, "ns/bundle", 10*chunk+4321, chunk)
	ranges := []cluster.Range{
		{Off: 3*chunk + chunk/2, Len: 100},  // inside chunk 3
		{Off: 7*chunk - 10, Len: 20},        // across chunks 6 and 7
		{Off: 0, Len: 0},                    // empty: reads nothing
		{Off: o.Size - 5, Len: 5},           // the short last chunk, 10
		{Off: 3*chunk + 7, Len: 9},          // chunk 3 again
		{Off: 8*chunk - 5, Len: chunk + 10}, // all of chunk 8 (read in place), ends of 7 and 9
		{Off: 8*chunk + 100, Len: 50},       // inside chunk 8: copied from where it was read
	}
	var exp []byte
	for i := range ranges {
		ranges[i].At = int64(len(exp)) // end to end
		exp = append(exp, want[ranges[i].Off:ranges[i].Off+ranges[i].Len]...)
	}
	dst := make([]byte, len(exp))
	_, read, err := b.P.PullRanges(ctx, o.Ref(), ranges, dst)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(dst, exp) {
		t.Fatal("the ranges read differ from the object's")
	}
	if wantRead := int64(5*chunk + 4321); read != wantRead || worker(a).Gets() != 6 {
		t.Fatalf("read %d bytes in %d GETs, want %d in 6 (chunks 3, 6-10)", read, worker(a).Gets(), wantRead)
	}
	if st := b.P.Stats(); st.PartialBytes != uint64(read) || st.Pulls != 0 {
		t.Errorf("stats %+v", st)
	}
	if b.Store.Len() != 0 {
		t.Fatal("a partial read left a local object")
	}
	if e, _ := b.Dir.Lookup(ctx, o.Ref()); strings.Join(e.Holders, ",") != "a" {
		t.Fatalf("holders after a partial read: %v", e.Holders)
	}
	testutil.Eventually(t, testutil.Wait, func() error {
		if k, err := a.Dir.Pinned(ctx, o.Ref()); k != 0 || err != nil || a.Store.Exposed() != 0 {
			return fmt.Errorf("A pinned by %d (%v), %d exposures", k, err, a.Store.Exposed())
		}
		return nil
	})

	// Bad ranges are refused before anything is read.
	for _, bad := range [][]cluster.Range{{{Off: o.Size - 1, Len: 2}}, {{Off: -1, Len: 1}}, {{Off: 0, Len: -1}}} {
		if _, _, err := b.P.PullRanges(ctx, o.Ref(), bad, make([]byte, 2)); !errors.Is(err, cluster.ErrBadRecord) {
			t.Errorf("range %+v: %v", bad, err)
		}
	}
	if _, _, err := b.P.PullRanges(ctx, o.Ref(), ranges[:1], make([]byte, 99)); err == nil {
		t.Error("a range beyond its destination was accepted")
	}

	// A corrupt chunk fails the read, naming it; one outside the ranges
	// does not matter.
	want[5*chunk] ^= 1
	if _, _, err := b.P.PullRanges(ctx, o.Ref(), []cluster.Range{{Off: 4 * chunk, Len: 10}}, make([]byte, 10)); err != nil {
		t.Fatalf("a range beside a corrupt chunk: %v", err)
	}
	_, _, err = b.P.PullRanges(ctx, o.Ref(), []cluster.Range{{Off: 5*chunk + 1, Len: 10}}, make([]byte, 10))
	if !errors.Is(err, cluster.ErrChecksum) || !strings.Contains(err.Error(), "chunk 5") {
		t.Fatalf("a range in a corrupt chunk: %v", err)
	}
}

// A partial read fails over to another holder when one dies.
func TestPullRangesFailover(t *testing.T) {
	srv := etcdtest.Start(t)
	nw := memtransport.NewNetwork()
	a, b, c := startNode(t, srv, nw, "a", secret), startNode(t, srv, nw, "b", secret), startNode(t, srv, nw, "c", secret)
	ctx := bounded(t, 30*time.Second)
	o, want := a.Put(t, "ns/tp", 8<<20, 256<<10)
	if _, err := b.P.Pull(ctx, o.Ref()); err != nil {
		t.Fatal(err)
	}
	waitHolders(t, ctx, c, o.Ref(), "a,b")
	worker(a).Kill()
	r := cluster.Range{Off: 1<<20 + 3, Len: 5 << 20}
	dst := make([]byte, r.Len)
	if _, _, err := c.P.PullRanges(ctx, o.Ref(), []cluster.Range{r}, dst); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(dst, want[r.Off:r.Off+r.Len]) {
		t.Fatal("the range read differs")
	}
}

// A tensor-parallel reader's slice of a bundle: the named tensors' ranges
// from its manifest, read and compared with the publisher's bytes.
func TestPullTensors(t *testing.T) {
	srv := etcdtest.Start(t)
	nw := memtransport.NewNetwork()
	a, b := startNode(t, srv, nw, "a", secret), startNode(t, srv, nw, "b", secret)
	ctx := bounded(t, 30*time.Second)
	var specs []bundle.Spec
	for i := range 8 {
		specs = append(specs, bundle.Spec{Name: fmt.Sprintf("layer.%d.weight", i), DType: "BF16", Shape: []int64{512, 384 + int64(i)}})
	}
	m, size, err := bundle.Layout(specs, bundle.Alignment, nil)
	if err != nil {
		t.Fatal(err)
	}
	o, want := a.Put(t, "ns/model", size, 256<<10)
	names := []string{"layer.5.weight", "layer.2.weight"}
	sm, n, ranges, err := cluster.TensorSlice(m, names)
	if err != nil {
		t.Fatal(err)
	}
	if len(sm.Tensors) != 2 || sm.Tensors[0].Name != "layer.2.weight" || sm.Tensors[1].Begin%bundle.Alignment != 0 || n != sm.Tensors[1].End {
		t.Fatalf("slice layout %+v, %d bytes", sm.Tensors, n)
	}
	dst := make([]byte, n)
	if _, read, err := b.P.PullRanges(ctx, o.Ref(), ranges, dst); err != nil || read >= size {
		t.Fatalf("read %d of %d bytes: %v", read, size, err)
	}
	for i, st := range sm.Tensors {
		tn := m.Tensors[m.Index(st.Name)]
		if !bytes.Equal(dst[st.Begin:st.End], want[tn.Begin:tn.End]) {
			t.Fatalf("tensor %s differs", st.Name)
		}
		if ranges[i] != (cluster.Range{Off: tn.Begin, Len: tn.Size(), At: st.Begin}) || st.DType != tn.DType || !slices.Equal(st.Shape, tn.Shape) {
			t.Fatalf("range of %s: %+v", st.Name, ranges[i])
		}
	}
	for _, bad := range [][]string{{"nope"}, {"layer.1.weight", "layer.1.weight"}} {
		if _, _, _, err := cluster.TensorSlice(m, bad); !errors.Is(err, cluster.ErrNoTensor) || !strings.Contains(err.Error(), bad[0]) {
			t.Errorf("tensors %v: %v", bad, err)
		}
	}
}
