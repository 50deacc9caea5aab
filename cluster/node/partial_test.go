package node_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc/bundle"
	"github.com/cudaipc/cudaipc/client"
	"github.com/cudaipc/cudaipc/cluster"
	"github.com/cudaipc/cudaipc/cluster/internal/etcdtest"
	"github.com/cudaipc/cudaipc/cluster/node"
	"github.com/cudaipc/cudaipc/internal/testutil"
)

// randomTensors makes n tensors of random bytes, of sizes around 3-5 MiB
// (so that the daemon's 4 MiB chunks and the tensors' ranges do not line
// up), named "layer.I.w".
func randomTensors(t *testing.T, seed byte, n int) []client.TensorData {
	t.Helper()
	specs := make([]bundle.Spec, n)
	for i := range specs {
		specs[i] = bundle.Spec{Name: fmt.Sprintf("layer.%d.w", i), DType: bundle.F32, Shape: []int64{1000, 800 + 97*int64(i)}}
	}
	return tensorsOf(t, seed, specs...)
}

// checkSlice checks that the lease and manifest of a subset get hold
// exactly the named tensors of want, byte for byte.
func checkSlice(t *testing.T, where string, l *client.Lease, m *bundle.Manifest, want []client.TensorData, names ...string) {
	t.Helper()
	checkTensors(t, where, l.Bytes(), m, want, names...)
}

// A get of some tensors of a bundle on a node that does not hold it reads
// only those tensors' chunks into a partial replica: bytes equal, bytes
// read about the subset's size, never a holder of the bundle, hidden from
// stat and list, leased again without reading on a repeat, and replaced by
// the whole bundle on a full get.
func TestPartialRead(t *testing.T) {
	_, a, b, ctx := twoDaemons(t, 60*time.Second)
	tensors := randomTensors(t, 3, 8)
	m, err := a.c.PutBundle(ctx, "model", tensors, map[string]string{"format": "pt"}, client.CreateOptions{Cluster: true})
	if err != nil {
		t.Fatal(err)
	}
	whole := m.Tensors[len(m.Tensors)-1].End
	e, err := b.node.Directory().Lookup(ctx, cluster.Ref{Name: "model"})
	if err != nil {
		t.Fatal(err)
	}

	names := []string{"layer.6.w", "layer.1.w"}
	l, sm, err := b.c.GetBundle(ctx, "model", client.GetOptions{Tensors: names})
	if err != nil {
		t.Fatal(err)
	}
	checkSlice(t, "B's slice", l, sm, tensors, names...)
	in := l.Info()
	if !in.Partial || in.Tensors != 2 || in.Size >= whole/2 || sm.Metadata["format"] != "pt" {
		t.Fatalf("B's slice: info %+v, metadata %v", in, sm.Metadata)
	}
	var subset int64
	for _, tn := range sm.Tensors {
		subset += tn.Size()
	}
	st := b.node.Stats()
	// What is read beyond the tensors is at most the chunk each range
	// starts in and the one it ends in.
	if st.PartialBytes < uint64(subset) || st.PartialBytes > uint64(subset+4*e.ChunkSize) || st.Bytes != 0 || st.Pulls != 0 {
		t.Fatalf("B read %d bytes for a subset of %d (bundle %d, chunk %d); full pulls %d bytes", st.PartialBytes, subset, whole, e.ChunkSize, st.Bytes)
	}
	t.Logf("subset of %d bytes of a %d-byte bundle: %d bytes read (chunk %d)", subset, whole, st.PartialBytes, e.ChunkSize)
	if m := metric(t, b.st, "cudaipc_cluster_partial_bytes_total"); m != fmt.Sprintf("%g", float64(st.PartialBytes)) {
		t.Fatalf("partial bytes metric %s, stats %d", m, st.PartialBytes)
	}

	// Not a holder of the bundle; not the bundle's name on B.
	if e, err := b.node.Directory().Lookup(ctx, cluster.Ref{Name: "model"}); err != nil || strings.Join(e.Holders, ",") != "a" {
		t.Fatalf("holders after a partial read: %v, %v", e.Holders, err)
	}
	if _, err := b.c.Stat(ctx, "model"); !errors.Is(err, client.ErrNotFound) {
		t.Fatalf("stat of the bundle on B, which holds only a slice: %v", err)
	}
	if infos, err := b.c.List(ctx); err != nil || len(infos) != 0 {
		t.Fatalf("list on B: %+v, %v", infos, err)
	}
	if b.st.Replicas().Slices() != 1 {
		t.Fatalf("B keeps %d slices", b.st.Replicas().Slices())
	}

	// The same tensors again, in another order: leased again, nothing read.
	l2, sm2, err := b.c.GetBundle(ctx, "model", client.GetOptions{Tensors: []string{"layer.1.w", "layer.6.w"}})
	if err != nil {
		t.Fatal(err)
	}
	checkSlice(t, "B's slice again", l2, sm2, tensors, names...)
	if st2 := b.node.Stats(); st2.PartialBytes != st.PartialBytes || b.st.Replicas().Slices() != 1 {
		t.Fatalf("a repeat read %d bytes more, %d slices", st2.PartialBytes-st.PartialBytes, b.st.Replicas().Slices())
	}
	l2.Release()

	// Bad names: INVALID naming them, nothing read.
	for _, bad := range [][]string{{"layer.1.w", "nope"}, {"layer.2.w", "layer.2.w"}, {""}} {
		_, _, err := b.c.GetBundle(ctx, "model", client.GetOptions{Tensors: bad})
		if !errors.Is(err, client.ErrInvalid) || !strings.Contains(err.Error(), fmt.Sprintf("%q", bad[len(bad)-1])) && bad[0] != "" {
			t.Errorf("tensors %q: %v", bad, err)
		}
	}
	// Tensors of an object that is no bundle: INVALID.
	a.put(t, "plain", 1<<20, client.CreateOptions{Cluster: true})
	if _, _, err := b.c.GetBundle(ctx, "plain", client.GetOptions{Tensors: []string{"x"}}); !errors.Is(err, client.ErrInvalid) || !strings.Contains(err.Error(), "not a bundle") {
		t.Errorf("tensors of a plain object: %v", err)
	}
	if st2 := b.node.Stats(); st2.PartialBytes != st.PartialBytes {
		t.Fatalf("bad gets read %d bytes", st2.PartialBytes-st.PartialBytes)
	}

	// A full get pulls the whole bundle; the slice it makes useless goes,
	// while the lease held on it keeps its bytes.
	fl, fm, err := b.c.GetBundle(ctx, "model", client.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if fl.Info().Partial || fl.Size() != l.Size() && fl.Size() < whole {
		t.Fatalf("full get after a partial one: %+v", fl.Info())
	}
	checkSlice(t, "B's whole", fl, fm, tensors, tensorNames(tensors)...)
	fl.Release()
	if st2 := b.node.Stats(); st2.Bytes != uint64(e.Size) {
		t.Fatalf("full pull read %d bytes of %d", st2.Bytes, e.Size)
	}
	if n := b.st.Replicas().Slices(); n != 0 {
		t.Fatalf("%d slices kept beside the whole bundle", n)
	}
	checkSlice(t, "B's slice, released after the whole came", l, sm, tensors, names...)
	l.Release()
	// Now a subset is the whole's lease, narrowed.
	l3, sm3, err := b.c.GetBundle(ctx, "model", client.GetOptions{Tensors: names})
	if err != nil {
		t.Fatal(err)
	}
	checkSlice(t, "B's subset of its whole", l3, sm3, tensors, names...)
	if l3.Info().Partial {
		t.Fatal("a subset of a bundle held whole is partial")
	}
	l3.Release()
}

// A partial replica is memory like any object's: it counts against the
// reader's capacity, an unleased one is evicted to make room, and the next
// get of those tensors reads them again.
func TestPartialReadEvicted(t *testing.T) {
	srv := etcdtest.Start(t)
	a, b := startDaemon(t, srv, "a"), startDaemonCap(t, srv, "b", 24<<20)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	tensors := randomTensors(t, 4, 8) // ~36 MiB: more than B's capacity
	if _, err := a.c.PutBundle(ctx, "model", tensors, nil, client.CreateOptions{Cluster: true}); err != nil {
		t.Fatal(err)
	}
	names := []string{"layer.2.w", "layer.5.w"}
	l, sm, err := b.c.GetBundle(ctx, "model", client.GetOptions{Tensors: names})
	if err != nil {
		t.Fatal(err)
	}
	checkSlice(t, "B's slice", l, sm, tensors, names...)
	l.Release()
	read := b.node.Stats().PartialBytes
	// B's own object takes the room the slice held.
	b.put(t, "local", 16<<20, client.CreateOptions{})
	if n := b.st.Replicas().Slices(); n != 0 {
		t.Fatalf("%d slices kept after B's memory was needed", n)
	}
	l, sm, err = b.c.GetBundle(ctx, "model", client.GetOptions{Tensors: names})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Release()
	checkSlice(t, "B's slice read again", l, sm, tensors, names...)
	if again := b.node.Stats().PartialBytes - read; again != read {
		t.Fatalf("read %d bytes again after the eviction, %d the first time", again, read)
	}
}

// Partial reads of a versioned bundle: each version's slice has that
// version's bytes, a newer version's slice drops the older one (whose
// lease keeps its bytes), a get newer_than waits for the next version,
// and the name's deletion drops every slice.
func TestPartialReadVersions(t *testing.T) {
	_, a, b, ctx := twoDaemons(t, 60*time.Second)
	publish := func(seed byte) []client.TensorData {
		t.Helper()
		ts := randomTensors(t, seed, 4)
		if _, err := a.c.PutBundle(ctx, "w", ts, nil, client.CreateOptions{Cluster: true, Versioned: true}); err != nil {
			t.Fatal(err)
		}
		return ts
	}
	v1 := publish(1)
	names := []string{"layer.2.w"}
	l1, m1, err := b.c.GetBundle(ctx, "w", client.GetOptions{Tensors: names})
	if err != nil {
		t.Fatal(err)
	}
	if in := l1.Info(); !in.Partial || in.Version != 1 {
		t.Fatalf("v1 slice: %+v", in)
	}
	checkSlice(t, "v1", l1, m1, v1, names...)

	v2 := publish(2)
	// B answers a get of the latest version from its mirror of the
	// directory, which learns of v2 from etcd's watch a moment after A's
	// publish returns.
	testutil.Eventually(t, testutil.Wait, func() error {
		if l, ok := b.node.Mirror().Latest(0, "w"); !ok || l.Version != 2 {
			return fmt.Errorf("node b's mirror shows latest %+v %v, want v2", l, ok)
		}
		return nil
	})
	l2, m2, err := b.c.GetBundle(ctx, "w", client.GetOptions{Tensors: names})
	if err != nil {
		t.Fatal(err)
	}
	if in := l2.Info(); !in.Partial || in.Version != 2 {
		t.Fatalf("v2 slice: %+v", in)
	}
	checkSlice(t, "v2", l2, m2, v2, names...)
	if n := b.st.Replicas().Slices(); n != 1 {
		t.Fatalf("B keeps %d slices after v2's", n)
	}
	checkSlice(t, "v1, leased before v2 came", l1, m1, v1, names...)
	l1.Release()
	// Other tensors of the same version, by number: a slice of their own
	// beside the first.
	lo, mo, err := b.c.GetBundle(ctx, "w", client.GetOptions{Version: 2, Tensors: []string{"layer.0.w", "layer.3.w"}})
	if err != nil {
		t.Fatal(err)
	}
	checkSlice(t, "v2 by number", lo, mo, v2, "layer.0.w", "layer.3.w")
	lo.Release()
	if n := b.st.Replicas().Slices(); n != 2 {
		t.Fatalf("B keeps %d slices of v2, want 2", n)
	}

	type got struct {
		l   *client.Lease
		m   *bundle.Manifest
		err error
	}
	next := make(chan got, 1)
	go func() {
		l, m, err := b.c.GetBundle(ctx, "w", client.GetOptions{NewerThan: 2, Wait: true, Tensors: names})
		next <- got{l, m, err}
	}()
	v3 := publish(3)
	g := <-next
	if g.err != nil {
		t.Fatal(g.err)
	}
	if in := g.l.Info(); !in.Partial || in.Version != 3 {
		t.Fatalf("newer_than 2: %+v", in)
	}
	checkSlice(t, "v3", g.l, g.m, v3, names...)
	g.l.Release()
	l2.Release()

	if err := a.c.Delete(ctx, "w"); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, testutil.Wait, func() error {
		if n := b.st.Replicas().Slices(); n != 0 {
			return fmt.Errorf("B keeps %d slices of a deleted name", n)
		}
		return nil
	})
}

// A partial read of a bundle in GPU memory: the slice is on the reader's
// GPU, its bytes the publisher's, and only the slice crossed host→device.
func TestPartialReadGPU(t *testing.T) {
	gpu, a, b, ctx := gpuDaemons(t, 1<<30)
	tensors := randomTensors(t, 9, 6)
	m, err := a.c.PutBundle(ctx, "gmodel", tensors, nil, client.CreateOptions{Cluster: true, Device: gpu})
	if err != nil {
		t.Fatal(err)
	}
	whole := m.Tensors[len(m.Tensors)-1].End
	staged := node.StagedBytes(b.node)
	names := []string{"layer.3.w", "layer.0.w"}
	l, sm, err := b.c.GetBundle(ctx, "gmodel", client.GetOptions{Tensors: names})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Release()
	got := readGPU(t, l)
	if !l.Info().Partial || int64(len(got)) >= whole {
		t.Fatalf("slice of a GPU bundle: %+v", l.Info())
	}
	for _, name := range names {
		tn := sm.Tensors[sm.Index(name)]
		for _, td := range tensors {
			if td.Name == name && !bytes.Equal(got[tn.Begin:tn.End], td.Data) {
				t.Fatalf("tensor %s differs on B's GPU", name)
			}
		}
	}
	if st := b.node.Stats(); st.PartialBytes == 0 || st.PartialBytes >= uint64(whole) || st.Bytes != 0 {
		t.Fatalf("B read %d bytes partially, %d whole, of a %d-byte bundle", st.PartialBytes, st.Bytes, whole)
	}
	if d := node.StagedBytes(b.node) - staged; d != uint64(sm.Tensors[len(sm.Tensors)-1].End) {
		t.Fatalf("B copied %d bytes host→device for a slice of %d", d, sm.Tensors[len(sm.Tensors)-1].End)
	}
}
