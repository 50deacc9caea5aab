package node_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc/client"
	"github.com/cudaipc/cudaipc/cluster/internal/etcdtest"
)

// A node caches the directory's record of a name it pulled; when the
// name is deleted and published again (another incarnation, other
// bytes), the next get on that node reads the new object, never the
// cached record's.
func TestCachedLookupFollowsRepublish(t *testing.T) {
	srv := etcdtest.Start(t)
	a, b := startDaemon(t, srv, "a"), startDaemon(t, srv, "b")
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	put := func(size int64) []byte {
		t.Helper()
		o, err := a.c.Create(ctx, "ns/obj", size, client.CreateOptions{Cluster: true})
		if err != nil {
			t.Fatal(err)
		}
		_, _ = rand.Read(o.Bytes())
		want := bytes.Clone(o.Bytes())
		if err := o.Seal(ctx); err != nil {
			t.Fatal(err)
		}
		return want
	}
	get := func(want []byte) {
		t.Helper()
		l, err := b.c.Get(ctx, "ns/obj")
		if err != nil {
			t.Fatal(err)
		}
		defer l.Release()
		if !bytes.Equal(l.Bytes(), want) {
			t.Fatalf("B read %d bytes that are not the current object's (%d bytes)", len(l.Bytes()), len(want))
		}
	}
	for round := range 3 {
		want := put(int64(4096 + 1000*round))
		get(want) // the first time reads etcd; B caches the record
		b.st.DropCluster(0, "ns/obj", "")
		get(want) // the cached record
		b.st.DropCluster(0, "ns/obj", "")
		if err := a.c.Delete(ctx, "ns/obj"); err != nil {
			t.Fatal(err)
		}
	}
}
