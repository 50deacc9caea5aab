package node_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc/bundle"
	"github.com/cudaipc/cudaipc/client"
	"github.com/cudaipc/cudaipc/cluster"
	"github.com/cudaipc/cudaipc/cluster/internal/etcdtest"
)

// A cluster-visible host bundle put on A is a bundle on B: the replica
// carries the manifest from A's record, and every tensor's bytes are A's.
func TestBundleAcrossDaemons(t *testing.T) {
	_, a, b, ctx := twoDaemons(t, 60*time.Second)

	tensors := tensorsOf(t, 7,
		bundle.Spec{Name: "embed", DType: bundle.F32, Shape: []int64{1000, 700}},
		bundle.Spec{Name: "layer.0.w", DType: bundle.BF16, Shape: []int64{3, 5, 7}},
		bundle.Spec{Name: "head", DType: bundle.U8, Shape: []int64{5 << 20}})
	if _, err := a.c.PutBundle(ctx, "model", tensors, map[string]string{"format": "pt"}, client.CreateOptions{Cluster: true}); err != nil {
		t.Fatal(err)
	}
	e, err := b.node.Directory().Lookup(ctx, cluster.Ref{Owner: 0, Name: "model"})
	if err != nil || len(e.Manifest) == 0 {
		t.Fatalf("record of the bundle: manifest of %d bytes, %v", len(e.Manifest), err)
	}
	l, m, err := b.c.GetBundle(ctx, "model", client.GetOptions{})
	if err != nil {
		t.Fatalf("bundle get on B: %v", err)
	}
	defer l.Release()
	if m.Metadata["format"] != "pt" {
		t.Fatalf("B's manifest: %+v", m)
	}
	checkTensors(t, "B's replica", l.Bytes(), m, tensors, tensorNames(tensors)...)
	// A subset get, local on A and on B (which holds a replica now):
	// the manifest names just those tensors, their bytes are A's.
	for _, d := range []*daemon{a, b} {
		sl, sm, err := d.c.GetBundle(ctx, "model", client.GetOptions{Tensors: []string{"head", "embed"}})
		if err != nil {
			t.Fatalf("subset get on %s: %v", d.name, err)
		}
		if len(sm.Tensors) != 2 || sm.Tensors[0].Name != "embed" || sm.Tensors[1].Name != "head" {
			t.Fatalf("subset manifest on %s: %+v", d.name, sm.Tensors)
		}
		checkTensors(t, "subset on "+d.name, sl.Bytes(), sm, tensors, "embed", "head")
		sl.Release()
	}
	for _, names := range [][]string{{"embed", "nope"}, {"head", "head"}} {
		if _, _, err := b.c.GetBundle(ctx, "model", client.GetOptions{Tensors: names}); !errors.Is(err, client.ErrInvalid) || !strings.Contains(err.Error(), fmt.Sprintf("%q", names[1])) {
			t.Fatalf("subset get of %q: %v", names, err)
		}
	}
	// The ranges a reader computes from the record are the tensors'.
	rm, err := bundle.Parse(e.Manifest)
	if err != nil {
		t.Fatal(err)
	}
	_, _, rs, err := cluster.TensorSlice(rm, []string{"layer.0.w"})
	if err != nil || len(rs) == 0 {
		t.Fatalf("ranges: %v %v", rs, err)
	}
}

// A bundle whose manifest would not fit in its record is refused at
// create, with the limit in the error.
func TestClusterBundleManifestLimit(t *testing.T) {
	srv := etcdtest.Start(t)
	a := startDaemon(t, srv, "a")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	specs := make([]bundle.Spec, 4000)
	for i := range specs {
		specs[i] = bundle.Spec{Name: strings.Repeat("x", 40) + string(rune('a'+i%26)) + strings.Repeat("y", i%7) + "." + strconv.Itoa(i), DType: bundle.U8, Shape: []int64{1}}
	}
	_, _, err := a.c.CreateBundle(ctx, "big", specs, nil, client.CreateOptions{Cluster: true})
	if !errors.Is(err, client.ErrInvalid) || !strings.Contains(err.Error(), "manifest is at most") {
		t.Fatalf("cluster bundle with a large manifest: %v", err)
	}
}

// A get whose replica does not fit on the reader fails STORE_FULL naming
// the reader's node and device, and leaves nothing behind there.
func TestRemoteGetStoreFullNamesNode(t *testing.T) {
	srv := etcdtest.Start(t)
	a, b := startDaemon(t, srv, "a"), startDaemonCap(t, srv, "small", 4<<20)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	a.put(t, "big", 8<<20, client.CreateOptions{Cluster: true})
	_, err := b.get(ctx, "big")
	if !errors.Is(err, client.ErrStoreFull) || !strings.Contains(err.Error(), "node small") || !strings.Contains(err.Error(), "device host") {
		t.Fatalf("get of an object too big for B: %v", err)
	}
	if _, err := b.c.Stat(ctx, "big"); !errors.Is(err, client.ErrNotFound) {
		t.Fatalf("stat on B after the failed pull: %v", err)
	}
}
