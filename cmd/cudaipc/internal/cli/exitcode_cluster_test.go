package cli

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/base64"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/cudaipc/cudaipc/internal/testutil"
	"github.com/cudaipc/cudaipc/transport/ucx"
)

// testEtcd runs the etcd binary on free loopback ports until the test
// ends, and returns its client URL and the process (for a kill).
func testEtcd(t *testing.T) (string, *exec.Cmd) {
	t.Helper()
	bin := os.Getenv("CUDAIPC_ETCD")
	if bin == "" {
		p, err := exec.LookPath("etcd")
		if err != nil {
			msg := "no etcd binary (apt-get install etcd-server, or set CUDAIPC_ETCD)"
			if os.Getenv("CUDAIPC_REQUIRE_CLUSTER") == "1" {
				t.Fatal(msg)
			}
			t.Skip(msg)
		}
		bin = p
	}
	var ports [2]int
	for i := range ports {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		ports[i] = ln.Addr().(*net.TCPAddr).Port
		ln.Close()
	}
	url := fmt.Sprintf("http://127.0.0.1:%d", ports[0])
	peer := fmt.Sprintf("http://127.0.0.1:%d", ports[1])
	dir := t.TempDir()
	cmd := exec.Command(bin, "--name", "t", "--data-dir", filepath.Join(dir, "etcd"),
		"--listen-client-urls", url, "--advertise-client-urls", url,
		"--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
		"--initial-cluster", "t="+peer, "--log-level", "warn")
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-exited
	})
	hc := http.Client{Timeout: time.Second}
	testutil.Eventually(t, 20*time.Second, func() error {
		r, err := hc.Get(url + "/health")
		if err != nil {
			return err
		}
		r.Body.Close()
		if r.StatusCode != 200 {
			return errors.New(r.Status)
		}
		return nil
	})
	return url, cmd
}

// TestClusterExitCodes: the cudaipc binary's exit status for a get on a
// daemon in a cluster, by class: a name the cluster does not have 3, a
// record that does not verify 5, etcd killed 4 (retry), each with a line
// saying what to do.
func TestClusterExitCodes(t *testing.T) {
	if err := ucx.Available(); err != nil {
		if os.Getenv("CUDAIPC_REQUIRE_UCX") == "1" {
			t.Fatal(err)
		}
		t.Skip(err)
	}
	url, etcd := testEtcd(t)
	dir := t.TempDir()
	key := make([]byte, 32)
	_, _ = rand.Read(key)
	secret := filepath.Join(dir, "cluster.secret")
	if err := os.WriteFile(secret, []byte(base64.StdEncoding.EncodeToString(key)), 0o600); err != nil {
		t.Fatal(err)
	}
	const prefix = "/cli-codes/"
	sock := serve(t, "--cluster", "etcd://"+strings.TrimPrefix(url, "http://"), "--cluster-secret", secret, "--node", "n1",
		"--cluster-listen", "127.0.0.1:0", "--config", writeConfig(t, "cluster-prefix = \""+prefix+"\"\n"), "--experimental-cluster-lanes", "1")
	ec, err := clientv3.New(clientv3.Config{Endpoints: []string{url}, DialTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer ec.Close()
	junk := make([]byte, 200)
	_, _ = rand.Read(junk)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := ec.Put(ctx, prefix+"obj/"+strconv.Itoa(os.Getuid())+"/forged/00000000000000000000/00000", string(junk)); err != nil {
		t.Fatal(err)
	}
	get := func(name string) (int, string) {
		cmd := exec.Command(os.Args[0], "get", name, "-o", filepath.Join(dir, "out"), "--socket", sock) // this binary as cudaipc
		cmd.Env = append(os.Environ(), mainEnv+"=1", "CUDAIPC_SOCKET=")
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		err := cmd.Run()
		var ee *exec.ExitError
		if err != nil && !errors.As(err, &ee) {
			t.Fatal(err)
		}
		return cmd.ProcessState.ExitCode(), strings.TrimSpace(stderr.String())
	}
	check := func(name string, want int, says string) {
		t.Helper()
		code, line := get(name)
		if code != want || !strings.Contains(line, says) || strings.Contains(line, "\n") {
			t.Errorf("get %s: exit %d, %q; want exit %d and one line with %q", name, code, line, want, says)
		} else {
			t.Logf("get %s: exit %d: %s", name, code, line)
		}
	}
	check("nowhere", ExitNotFound, "no such object")
	check("forged", ExitDataLoss, "retrying does not help")
	_ = etcd.Process.Kill()
	check("elsewhere", ExitUnavailable, "retry later")
}
