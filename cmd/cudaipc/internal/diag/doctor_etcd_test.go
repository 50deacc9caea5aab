package diag

import (
	"context"
	"os/exec"
	"strings"
	"testing"
	"time"
)

// The doctor's etcd line: ok with the server's version while etcd runs,
// fail naming the endpoint once it is stopped, skip without a cluster.
func TestEtcdCheck(t *testing.T) {
	if _, err := exec.LookPath("etcd"); err != nil {
		t.Skip("no etcd binary (apt-get install etcd-server)")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if _, st, _ := etcdCheck(ctx, &DoctorCmd{}); st != "skip" {
		t.Fatalf("without --cluster: %s", st)
	}
	s, err := startEtcd(ctx, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	url := "etcd://" + strings.TrimPrefix(s.endpoint, "http://")
	_, st, detail := etcdCheck(ctx, &DoctorCmd{Cluster: url, ClusterPrefix: "/cudaipc/v1/"})
	if st != "ok" || !strings.Contains(detail, "(etcd 3.") || !strings.Contains(detail, "0 live node(s)") {
		t.Fatalf("etcd running: %s: %s", st, detail)
	}
	s.stop()
	_, st, detail = etcdCheck(ctx, &DoctorCmd{Cluster: url})
	if st != "fail" || !strings.Contains(detail, s.endpoint) {
		t.Fatalf("etcd stopped: %s: %s", st, detail)
	}
	if _, st, detail = etcdCheck(ctx, &DoctorCmd{Cluster: "http://x:1"}); st != "fail" || !strings.Contains(detail, "--cluster") {
		t.Fatalf("a bad URL: %s: %s", st, detail)
	}
}
