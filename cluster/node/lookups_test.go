package node_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"fmt"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc/client"
	"github.com/cudaipc/cudaipc/cluster"
	"github.com/cudaipc/cudaipc/cluster/internal/etcdtest"
	"github.com/cudaipc/cudaipc/internal/testutil"
)

// A node answers lookups from its mirror of the directory; when a name
// is deleted and published again (another incarnation, other bytes), the
// next get on any node reads the new object, never the old record's. Each round waits until every node dropped its replica
// of the deleted name: until its watch sees the delete, a node still
// serves its replica of the old incarnation locally, which is not what
// this test is about (TestRecreatedBeforeWatchSeesDelete is).
func TestCachedLookupFollowsRepublish(t *testing.T) {
	srv := etcdtest.Start(t)
	a, b, c := startDaemon(t, srv, "a"), startDaemon(t, srv, "b"), startDaemon(t, srv, "c")
	all := []*daemon{a, b, c}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	put := func(p *daemon, size int64) []byte {
		t.Helper()
		o, err := p.c.Create(ctx, "ns/obj", size, client.CreateOptions{Cluster: true})
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
	get := func(r *daemon, want []byte) {
		t.Helper()
		l, err := r.c.Get(ctx, "ns/obj")
		if err != nil {
			t.Fatal(err)
		}
		defer l.Release()
		if !bytes.Equal(l.Bytes(), want) {
			t.Fatalf("node %s read %d bytes that are not the current object's (%d bytes)", r.name, len(l.Bytes()), len(want))
		}
	}
	for round, p := range []*daemon{a, c, c, a} {
		want := put(p, int64(4096+1000*round))
		testutil.Eventually(t, testutil.Wait, func() error {
			if _, ok := b.node.Mirror().Lookup(cluster.Ref{Name: "ns/obj"}); !ok {
				return fmt.Errorf("node b's mirror lacks round %d's object", round)
			}
			return nil
		})
		hits, _ := b.node.Mirror().Stats()
		get(b, want)
		b.st.Replicas().Drop(0, "ns/obj", "")
		get(b, want)
		if h, _ := b.node.Mirror().Stats(); h == hits {
			t.Fatalf("round %d: B's gets never found the record in its mirror", round)
		}
		for _, r := range all {
			if r != p && r != b {
				get(r, want)
			}
		}
		if err := p.c.Delete(ctx, "ns/obj"); err != nil {
			t.Fatal(err)
		}
		for _, r := range all {
			testutil.Eventually(t, testutil.Wait, func() error {
				if r.st.Replicas().Has(0, "ns/obj", 0, 0) {
					return fmt.Errorf("node %s still holds the deleted name", r.name)
				}
				return nil
			})
		}
	}
}

// A get of a versioned name's latest, or of a version newer than one the
// mirror already shows committed, finds the version and its shards in
// the node's mirror.
func TestVersionsFromTheMirror(t *testing.T) {
	_, a, b, ctx := twoDaemons(t, 60*time.Second)
	v1, _ := a.publish(t, "mirrored", 2, 5000)
	v2, s2 := a.publish(t, "mirrored", 2, 5000)
	testutil.Eventually(t, testutil.Wait, func() error {
		l, ok := b.node.Mirror().Latest(0, "mirrored")
		if !ok || l.Version != v2 {
			return fmt.Errorf("node b's mirror shows latest %+v %v, want v%d", l, ok, v2)
		}
		for shard := range 2 {
			if _, ok := b.node.Mirror().Lookup(cluster.Ref{Name: "mirrored", Version: v2, Shard: uint32(shard)}); !ok {
				return fmt.Errorf("node b's mirror lacks shard %d", shard)
			}
		}
		return nil
	})
	hits, _ := b.node.Mirror().Stats()
	ver, got, err := b.getVersion(ctx, "mirrored", client.GetOptions{NewerThan: v1, Wait: true})
	if err != nil || ver != v2 || !bytes.Equal(got, s2[0]) {
		t.Fatalf("newer than v%d on b: v%d %v (want v%d)", v1, ver, err, v2)
	}
	if ver, got, err = b.getVersion(ctx, "mirrored", client.GetOptions{Version: v2, Shard: 1}); err != nil || ver != v2 || !bytes.Equal(got, s2[1]) {
		t.Fatalf("shard 1 of v%d on b: v%d %v", v2, ver, err)
	}
	if h, _ := b.node.Mirror().Stats(); h < hits+2 {
		t.Fatalf("node b's mirror answered %d of the version's lookups, want both shards", h-hits)
	}
}

// A get waiting for a newer version wakes on the directory's watch the
// moment the version is committed, which can be before the publishing
// node's store has recorded the incarnation it just published: the
// holder waits for its own seal instead of answering that it does not
// hold the object. Every such get succeeds.
func TestNewerThanRacesThePublishersSeal(t *testing.T) {
	_, a, b, ctx := twoDaemons(t, 90*time.Second)
	v, _ := a.publish(t, "race", 1, 4096)
	for range 40 {
		type result struct {
			ver uint64
			got []byte
			err error
		}
		next := make(chan result, 1)
		after := v
		go func() {
			ver, got, err := b.getVersion(ctx, "race", client.GetOptions{NewerThan: after, Wait: true})
			next <- result{ver, got, err}
		}()
		time.Sleep(2 * time.Millisecond) // the get is waiting on the watch
		var want [][]byte
		v, want = a.publish(t, "race", 1, 4096)
		r := <-next
		if r.err != nil || r.ver != v || !bytes.Equal(r.got, want[0]) {
			t.Fatalf("get newer than v%d on b: v%d %v (want v%d)", v-1, r.ver, r.err, v)
		}
	}
}
