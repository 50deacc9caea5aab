package node_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/url"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/cudaipc/cudaipc/client"
	"github.com/cudaipc/cudaipc/cluster"
	"github.com/cudaipc/cudaipc/cluster/internal/etcdtest"
	"github.com/cudaipc/cudaipc/cluster/node"
	"github.com/cudaipc/cudaipc/internal/testutil"
)

// Faults of the directory made by someone with write access to etcd but
// not the cluster secret (etcdctl del/put), against real daemons: the
// directory is an index, and nothing done to it deletes data.

// rewriteBound is how soon a node writes back a record of its own that
// went or changed: docs/cluster.md says within a second of its watch
// seeing the change; the tests allow for a loaded machine.
const rewriteBound = 3 * time.Second

// rawEtcd is a plain etcd client, as etcdctl is: no secret.
func rawEtcd(t *testing.T, srv *etcdtest.Server) *clientv3.Client {
	t.Helper()
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{srv.Endpoint()}, DialTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cli.Close() })
	return cli
}

// prefix is the test's cluster key prefix (startDaemon's).
func prefix(t *testing.T) string { return "/t/" + t.Name() + "/" }

// namePath is the key path of a name of the test's uid: "UID/NAME".
func namePath(name string) string {
	return strconv.Itoa(os.Getuid()) + "/" + url.PathEscape(name)
}

func uid() uint32 { return uint32(os.Getuid()) }

// logCount counts the lines of d's log with s.
func (d *daemon) logCount(s string) int {
	d.logMu.Lock()
	defer d.logMu.Unlock()
	return strings.Count(d.logBuf.String(), s)
}

// After etcdctl del of one object's record, and then of every prefix of
// the cluster's keys (obj/, hold/, latest/, node/, the whole prefix),
// every holder, the origin among them, keeps its objects and reads the
// right bytes, and the directory shows every record again, with its
// holders, within the bound. A node that held nothing then reads them.
func TestDirectoryCannotDeleteData(t *testing.T) {
	srv := etcdtest.Start(t)
	a, b, c := startDaemon(t, srv, "a"), startDaemon(t, srv, "b"), startDaemon(t, srv, "c")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	plain := a.put(t, "ns/plain", 3<<20+11, client.CreateOptions{Cluster: true})
	onlyA := a.put(t, "ns/only-a", 70001, client.CreateOptions{Cluster: true})
	ver, shards := a.publish(t, "pol", 1, 5<<20+3)
	if got, err := b.get(ctx, "ns/plain"); err != nil || !bytes.Equal(got, plain) {
		t.Fatalf("B's get of ns/plain: %v", err)
	}
	if v, got, err := b.getVersion(ctx, "pol", client.GetOptions{}); err != nil || v != ver || !bytes.Equal(got, shards[0]) {
		t.Fatalf("B's get of pol: v%d %v", v, err)
	}
	dir := c.node.Directory()
	recorded := func() error {
		for _, want := range []struct {
			ref     cluster.Ref
			holders []string
		}{
			{cluster.Ref{Owner: uid(), Name: "ns/plain"}, []string{"a", "b"}},
			{cluster.Ref{Owner: uid(), Name: "ns/only-a"}, []string{"a"}},
			{cluster.Ref{Owner: uid(), Name: "pol", Version: ver}, []string{"a", "b"}},
		} {
			e, err := dir.Lookup(ctx, want.ref)
			if err != nil {
				return err
			}
			if !slices.Equal(e.Holders, want.holders) {
				return fmt.Errorf("%s: holders %v, want %v", want.ref, e.Holders, want.holders)
			}
		}
		if l, err := dir.Latest(ctx, uid(), "pol"); err != nil || l.Version != ver {
			return fmt.Errorf("latest of pol: %+v %v, want v%d", l, err, ver)
		}
		ns, err := dir.Nodes(ctx)
		if err != nil || len(ns) != 3 {
			return fmt.Errorf("nodes %+v %v, want a, b and c", ns, err)
		}
		return nil
	}
	readable := func() {
		t.Helper()
		for _, d := range []*daemon{a, b} {
			if got, err := d.get(ctx, "ns/plain"); err != nil || !bytes.Equal(got, plain) {
				t.Fatalf("%s lost ns/plain: %v", d.name, err)
			}
			if v, got, err := d.getVersion(ctx, "pol", client.GetOptions{Version: ver}); err != nil || v != ver || !bytes.Equal(got, shards[0]) {
				t.Fatalf("%s lost pol v%d: %v", d.name, ver, err)
			}
		}
		if got, err := a.get(ctx, "ns/only-a"); err != nil || !bytes.Equal(got, onlyA) {
			t.Fatalf("a lost ns/only-a, which only it holds: %v", err)
		}
	}
	testutil.Eventually(t, testutil.Wait, recorded)
	raw := rawEtcd(t, srv)
	p := prefix(t)
	for _, del := range []string{"obj/" + namePath("ns/plain") + "/", "obj/", "hold/", "latest/", "node/", ""} {
		r, err := raw.Delete(ctx, p+del, clientv3.WithPrefix())
		if err != nil {
			t.Fatal(err)
		}
		deleted := time.Now()
		testutil.Eventually(t, rewriteBound, recorded)
		t.Logf("del --prefix %s (%d keys): every record back after %v", p+del, r.Deleted, time.Since(deleted).Round(time.Millisecond))
		readable()
	}
	if got, err := c.get(ctx, "ns/plain"); err != nil || !bytes.Equal(got, plain) {
		t.Fatalf("C's get of ns/plain after the deletions: %v", err)
	}
	if got, err := c.get(ctx, "ns/only-a"); err != nil || !bytes.Equal(got, onlyA) {
		t.Fatalf("C's get of ns/only-a after the deletions: %v", err)
	}
	if v, got, err := c.getVersion(ctx, "pol", client.GetOptions{}); err != nil || v != ver || !bytes.Equal(got, shards[0]) {
		t.Fatalf("C's get of pol after the deletions: v%d %v", v, err)
	}
	// Logged once per key, however many times it was written back: A's
	// records are its node record, three object records, their three
	// holder records and pol's latest record.
	if n := a.logCount("written back;"); n > 8 {
		t.Errorf("A logged %d first rewrites, want at most one per record of its own (8)", n)
	}
	if n := a.node.Directory().Rewrites() + b.node.Directory().Rewrites(); n < 6 {
		t.Errorf("A and B count %d records written back (cudaipc_cluster_records_rewritten_total), want at least one a deletion", n)
	}
}

// The owner's delete still removes the name from every holder: its
// tombstone, sealed with the secret, is honoured. A tombstone that does
// not verify (garbage, sealed with another secret) deletes nothing.
func TestTombstoneHonouredForgedIgnored(t *testing.T) {
	srv, a, b, ctx := twoDaemons(t, 2*time.Minute)
	want := a.put(t, "ns/x", 2<<20+7, client.CreateOptions{Cluster: true})
	a.put(t, "ns/sentinel", 5000, client.CreateOptions{Cluster: true})
	for _, name := range []string{"ns/x", "ns/sentinel"} {
		if _, err := b.get(ctx, name); err != nil {
			t.Fatal(err)
		}
	}
	e, err := a.node.Directory().Lookup(ctx, cluster.Ref{Owner: uid(), Name: "ns/x"})
	if err != nil {
		t.Fatal(err)
	}
	tkey := prefix(t) + "tomb/" + namePath("ns/x")
	evil, err := cluster.NewSecret([]byte("another-secret-of-16+bytes"))
	if err != nil {
		t.Fatal(err)
	}
	forged, err := cluster.Seal(evil, tkey, &cluster.Tombstone{Owner: uid(), Name: "ns/x", IDs: []string{e.ID}, Node: "a", Deleted: time.Now()})
	if err != nil {
		t.Fatal(err)
	}
	raw := rawEtcd(t, srv)
	for _, v := range []string{"garbage", string(forged)} {
		if _, err := raw.Put(ctx, tkey, v); err != nil {
			t.Fatal(err)
		}
	}
	// The owner deletes another name: once B dropped it, its watch has
	// seen the forged tombstones (it reports in revision order).
	if err := a.c.Delete(ctx, "ns/sentinel"); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, testutil.Wait, func() error {
		if b.st.Replicas().Has(uid(), "ns/sentinel", 0, 0) {
			return errors.New("B still holds ns/sentinel after its owner deleted it")
		}
		return nil
	})
	for _, d := range []*daemon{a, b} {
		if got, err := d.get(ctx, "ns/x"); err != nil || !bytes.Equal(got, want) {
			t.Fatalf("%s lost ns/x to a forged tombstone: %v", d.name, err)
		}
	}
	if err := a.c.Delete(ctx, "ns/x"); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, testutil.Wait, func() error {
		if b.st.Replicas().Has(uid(), "ns/x", 0, 0) {
			return errors.New("B still holds ns/x after its owner deleted it")
		}
		return nil
	})
	gctx, gcancel := context.WithTimeout(ctx, 5*time.Second)
	defer gcancel()
	if _, err := b.get(gctx, "ns/x"); err == nil {
		t.Fatal("B read ns/x after its owner deleted it")
	}
}

// A node record overwritten with garbage without a lease (it would never
// expire) for a killed node's name: the node restarts and joins over it at
// once. A live node whose record is overwritten writes it back, and logs
// it once however often it happens.
func TestGarbageNodeRecordRejoin(t *testing.T) {
	srv := etcdtest.Start(t)
	a := startDaemon(t, srv, "a")
	h := startHelperDaemon(t, srv, "n1", "host", 64<<20, 0)
	raw := rawEtcd(t, srv)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	h.kill(t)
	key := prefix(t) + "node/n1"
	if _, err := raw.Put(ctx, key, "garbage"); err != nil {
		t.Fatal(err)
	}
	if _, err := a.node.Directory().Node(ctx, "n1"); !errors.Is(err, cluster.ErrBadRecord) {
		t.Fatalf("n1's garbage record: %v, want ErrBadRecord (not a live node)", err)
	}
	start := time.Now()
	startHelperDaemon(t, srv, "n1", "host", 64<<20, 0)
	t.Logf("n1 joined over its garbage record %v after its start", time.Since(start).Round(time.Millisecond))
	r, err := raw.Get(ctx, key)
	if err != nil || len(r.Kvs) != 1 || r.Kvs[0].Lease == 0 {
		t.Fatalf("n1's record after its restart: %+v %v, want one on a lease", r, err)
	}
	if _, err := a.node.Directory().Node(ctx, "n1"); err != nil {
		t.Fatalf("n1 after its restart: %v", err)
	}
	// A live node's record, overwritten three times.
	akey := prefix(t) + "node/a"
	for i := range 3 {
		if _, err := raw.Put(ctx, akey, "garbage "+strconv.Itoa(i)); err != nil {
			t.Fatal(err)
		}
		changed := time.Now()
		testutil.Eventually(t, rewriteBound, func() error {
			r, err := raw.Get(ctx, akey)
			if err != nil || len(r.Kvs) != 1 || r.Kvs[0].Lease == 0 {
				return fmt.Errorf("a's record: %v %v", r, err)
			}
			_, err = a.node.Directory().Node(ctx, "a")
			return err
		})
		t.Logf("a's record written back %v after it was overwritten", time.Since(changed).Round(time.Millisecond))
	}
	if n := a.logCount("written back;"); n != 1 {
		t.Errorf("a logged the rewrite of its record %d times, want once", n)
	}
}

// A daemon whose cluster secret does not verify the other nodes' records
// says so at start, at ERROR, naming them.
func TestWrongSecretLoudAtStart(t *testing.T) {
	srv := etcdtest.Start(t)
	startDaemon(t, srv, "a")
	startDaemon(t, srv, "b")
	other, err := cluster.NewSecret([]byte("not-the-cluster-secret-at-all"))
	if err != nil {
		t.Fatal(err)
	}
	w := startDaemonWith(t, srv, "w", 64<<20, "host", func(c *node.Config) { c.Directory.Secret = other })
	if !w.logged("level=ERROR") || !w.logged("secrets probably differ") || !w.logged("nodes=\"[a b]\"") {
		t.Fatal("the wrong-secret daemon did not say at start, at ERROR, that the other nodes' records do not verify")
	}
}
