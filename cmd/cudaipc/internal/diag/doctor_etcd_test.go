package diag

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/cudaipc/cudaipc/cluster"
	"github.com/cudaipc/cudaipc/cluster/etcddir"
)

// requireEtcd skips without an etcd binary, or fails under
// CUDAIPC_REQUIRE_CLUSTER=1.
func requireEtcd(t *testing.T) {
	t.Helper()
	if _, err := exec.LookPath("etcd"); err != nil && os.Getenv("CUDAIPC_ETCD") == "" {
		msg := "no etcd binary (apt-get install etcd-server, or set CUDAIPC_ETCD)"
		if os.Getenv("CUDAIPC_REQUIRE_CLUSTER") == "1" {
			t.Fatal(msg)
		}
		t.Skip(msg)
	}
}

// The doctor's etcd line: ok with the server's version while etcd runs,
// fail naming the endpoint once it is stopped, skip without a cluster.
func TestEtcdCheck(t *testing.T) {
	requireEtcd(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if chs := etcdChecks(ctx, &DoctorCmd{}); len(chs) != 1 || chs[0].Status != "skip" {
		t.Fatalf("without --cluster: %+v", chs)
	}
	s, err := startEtcd(ctx, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	url := "etcd://" + strings.TrimPrefix(s.endpoint, "http://")
	chs := etcdChecks(ctx, &DoctorCmd{Cluster: url, ClusterPrefix: "/cudaipc/v1/"})
	if len(chs) != 2 || chs[0].Status != "ok" || !strings.Contains(chs[0].Detail, "(etcd 3.") ||
		!strings.Contains(chs[1].Detail, "0 node key(s) and 0 object key(s) under /cudaipc/v1/, not verified") {
		t.Fatalf("etcd running: %+v", chs)
	}
	s.stop()
	chs = etcdChecks(ctx, &DoctorCmd{Cluster: url})
	if len(chs) != 1 || chs[0].Status != "fail" || !strings.Contains(chs[0].Detail, s.endpoint) {
		t.Fatalf("etcd stopped: %+v", chs)
	}
	if chs = etcdChecks(ctx, &DoctorCmd{Cluster: "http://x:1"}); chs[0].Status != "fail" || !strings.Contains(chs[0].Detail, "--cluster") {
		t.Fatalf("a bad URL: %+v", chs)
	}
}

// secretFile writes a random cluster secret to a 0600 file.
func secretFile(t *testing.T, dir, name string) (string, cluster.Secret) {
	t.Helper()
	key := make([]byte, 32)
	_, _ = rand.Read(key)
	path := filepath.Join(dir, name)
	if err := os.WriteFile(path, []byte(base64.StdEncoding.EncodeToString(key)+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	sec, err := cluster.LoadSecret(path)
	if err != nil {
		t.Fatal(err)
	}
	return path, sec
}

// joinAs joins the cluster under prefix as a node named name (its record
// on its lease, as a daemon's) and returns its directory.
func joinAs(t *testing.T, ctx context.Context, endpoint, prefix, name string, sec cluster.Secret) *etcddir.Directory {
	t.Helper()
	d, err := etcddir.Open(ctx, etcddir.Config{Endpoints: []string{endpoint}, Prefix: prefix, Node: name, Secret: sec, TTL: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	if err := d.Join(ctx, cluster.Node{Name: name, Control: "127.0.0.1:1"}); err != nil {
		t.Fatal(err)
	}
	return d
}

func publish(t *testing.T, ctx context.Context, d *etcddir.Directory, name string) {
	t.Helper()
	b := make([]byte, 100<<10)
	_, _ = rand.Read(b)
	chunk := cluster.ChunkSizeFor(int64(len(b)))
	if _, err := d.Publish(ctx, cluster.Object{Name: name, Owner: 1000, Size: int64(len(b)), ChunkSize: chunk,
		Sums: cluster.Checksums(b, chunk), ID: cluster.NewID()}); err != nil {
		t.Fatal(err)
	}
}

// TestDoctorClusterRecords: with the cluster secret, doctor tells the
// verified live nodes from node records that do not verify (garbage, one
// of another secret) or live on no lease, and object records that do not
// verify (one copied under another name's key, one of another secret),
// and fails; in --json too, with each bad key. Without the secret it
// counts keys only and says so; a clean cluster passes.
func TestDoctorClusterRecords(t *testing.T) {
	requireEtcd(t)
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	dir := t.TempDir()
	s, err := startEtcd(ctx, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	defer s.stop()
	url := "etcd://" + strings.TrimPrefix(s.endpoint, "http://")
	secPath, sec := secretFile(t, dir, "cluster.secret")
	_, other := secretFile(t, dir, "other.secret")
	const prefix = "/doctor/v1/"

	a := joinAs(t, ctx, s.endpoint, prefix, "a", sec)
	joinAs(t, ctx, s.endpoint, prefix, "b", sec)
	joinAs(t, ctx, s.endpoint, prefix, "c", sec)
	publish(t, ctx, a, "w0")
	publish(t, ctx, a, "w1")
	// Another secret's node and object.
	publish(t, ctx, joinAs(t, ctx, s.endpoint, prefix, "n5", other), "strange")
	ec, err := clientv3.New(clientv3.Config{Endpoints: []string{s.endpoint}, DialTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer ec.Close()
	// Garbage under a node's key.
	junk := make([]byte, 64)
	_, _ = rand.Read(junk)
	mustPut(t, ctx, ec, prefix+"node/n4", string(junk))
	// A node record of this secret on no lease.
	rec, err := cluster.Seal(sec, prefix+"node/n6", &cluster.Node{Name: "n6", Control: "127.0.0.1:1", Started: time.Now()})
	if err != nil {
		t.Fatal(err)
	}
	mustPut(t, ctx, ec, prefix+"node/n6", string(rec))
	// A genuine object record copied under another name's key.
	r, err := ec.Get(ctx, prefix+"obj/1000/w0/", clientv3.WithPrefix())
	if err != nil || len(r.Kvs) != 1 {
		t.Fatalf("w0's record: %v, %d keys", err, len(r.Kvs))
	}
	mustPut(t, ctx, ec, prefix+"obj/1000/forged/00000000000000000000/00000", string(r.Kvs[0].Value))

	// With the secret.
	cmd := &DoctorCmd{Cluster: url, ClusterPrefix: prefix, ClusterSecret: secPath}
	chs := etcdChecks(ctx, cmd)
	if len(chs) != 2 || chs[0].Status != "ok" {
		t.Fatalf("etcd line: %+v", chs)
	}
	rc := chs[1]
	t.Logf("%s %s: %s", rc.Status, rc.Name, rc.Detail)
	for _, want := range []string{
		"under /doctor/v1/: 3 verified live node(s) (a, b, c)",
		"2 object record(s) and ",
		"3 node record(s) do not verify: n4 (not a cudaipc record (64 bytes)), n5 (forged or another secret), n6 (verifies, but lives on no lease",
		"2 object record(s) do not verify: 1000:forged (forged or another secret), 1000:strange (forged or another secret)",
		"1 holder record(s) do not verify: 1000:strange on n5 (forged or another secret)",
		"etcdctl del",
	} {
		if rc.Status != "fail" || !strings.Contains(rc.Detail, want) {
			t.Errorf("cluster records: %s: %q lacks %q", rc.Status, rc.Detail, want)
		}
	}
	// --json: the same, with the keys to delete.
	var back []check
	js, err := json.Marshal(chs)
	if err == nil {
		err = json.Unmarshal(js, &back)
	}
	if err != nil || len(back) != 2 || back[1].Cluster == nil || back[1].Cluster.Audit == nil {
		t.Fatalf("json: %v: %s", err, js)
	}
	got := back[1].Cluster
	var keys []string
	for _, b := range got.Bad {
		keys = append(keys, b.Kind+" "+b.Key)
	}
	wantKeys := []string{"hold " + prefix + "hold/1000/strange/00000000000000000000/00000/n5", "node " + prefix + "node/n4", "node " + prefix + "node/n5", "node " + prefix + "node/n6",
		"obj " + prefix + "obj/1000/forged/00000000000000000000/00000", "obj " + prefix + "obj/1000/strange/00000000000000000000/00000"}
	if !got.Verified || !slices.Equal(got.LiveNodes, []string{"a", "b", "c"}) || got.Objects != 2 || got.NodeKeys != 6 || got.ObjectKeys != 4 ||
		!slices.Equal(keys, wantKeys) {
		t.Errorf("json: %s\nbad keys %q, want %q", js, keys, wantKeys)
	}

	// Without the secret: keys counted, and said to prove nothing.
	cmd.ClusterSecret = ""
	rc = etcdChecks(ctx, cmd)[1]
	if rc.Status != "warn" || !strings.Contains(rc.Detail, "6 node key(s) and 4 object key(s) under /doctor/v1/, not verified") ||
		!strings.Contains(rc.Detail, "--cluster-secret") || rc.Cluster.Verified || rc.Cluster.Audit != nil {
		t.Errorf("without the secret: %+v", rc)
	}
	// A wrong secret file fails naming the flag.
	cmd.ClusterSecret = filepath.Join(dir, "absent")
	if chs := etcdChecks(ctx, cmd); chs[0].Status != "fail" || !strings.Contains(chs[0].Detail, "--cluster-secret") {
		t.Errorf("absent secret file: %+v", chs)
	}

	// A clean cluster under another prefix passes, through the whole
	// command and its --json.
	const clean = "/clean/v1/"
	joinAs(t, ctx, s.endpoint, clean, "a", sec)
	publish(t, ctx, joinAs(t, ctx, s.endpoint, clean, "b", sec), "w0")
	var out bytes.Buffer
	env := &Env{Ctx: ctx, Stdout: &out, Stderr: &out, Socket: filepath.Join(dir, "no.sock")}
	dc := &DoctorCmd{JSON: true, Cluster: url, ClusterPrefix: clean, ClusterSecret: secPath}
	runErr := dc.Run(env)
	var all []check
	if err := json.Unmarshal(out.Bytes(), &all); err != nil {
		t.Fatalf("doctor --json: %v: %s", err, out.String())
	}
	found := false
	for _, ch := range all {
		if ch.Name == "cluster records" {
			found = true
			if ch.Status != "ok" || !strings.HasPrefix(ch.Detail, "under /clean/v1/: 2 verified live node(s) (a, b); 1 object record(s) and ") || len(ch.Cluster.Bad) != 0 {
				t.Errorf("clean cluster: %+v", ch)
			}
		}
		if ch.Status == "fail" {
			t.Logf("doctor here: fail %s: %s (%v)", ch.Name, ch.Detail, runErr)
		}
	}
	if !found {
		t.Fatalf("doctor --json has no cluster records line: %s", out.String())
	}
}

func mustPut(t *testing.T, ctx context.Context, ec *clientv3.Client, key, val string) {
	t.Helper()
	if _, err := ec.Put(ctx, key, val); err != nil {
		t.Fatal(err)
	}
}
