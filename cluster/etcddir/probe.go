package etcddir

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"go.etcd.io/etcd/client/pkg/v3/transport"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
)

// EndpointStatus is what Probe learned of one etcd endpoint.
type EndpointStatus struct {
	Endpoint string
	// Version is the etcd server's version; Err why it did not answer.
	Version string
	Err     error
}

// ProbeResult is Probe's answer.
type ProbeResult struct {
	Endpoints []EndpointStatus
	// Nodes counts the live node records under the prefix (keys only:
	// reading them needs the cluster secret); -1 when no endpoint answered.
	Nodes int
}

// Probe checks, for 'cudaipc doctor', that each endpoint of cfg answers
// (its version) within timeout and counts the live nodes under cfg.Prefix.
// Only Endpoints, Prefix and the TLS fields of cfg are used; nothing is
// written.
func Probe(ctx context.Context, cfg Config, timeout time.Duration) (ProbeResult, error) {
	res := ProbeResult{Nodes: -1}
	if len(cfg.Endpoints) == 0 {
		return res, errors.New("etcd probe: no endpoints")
	}
	prefix := cfg.Prefix
	if prefix == "" {
		prefix = DefaultPrefix
	}
	if !strings.HasSuffix(prefix, "/") {
		prefix += "/"
	}
	tlsCfg := cfg.TLS
	if tlsCfg == nil && (cfg.CAFile != "" || cfg.CertFile != "" || cfg.KeyFile != "") {
		if (cfg.CertFile == "") != (cfg.KeyFile == "") {
			return res, errors.New("etcd TLS: give both the client certificate and its key, or neither")
		}
		info := transport.TLSInfo{CertFile: cfg.CertFile, KeyFile: cfg.KeyFile, TrustedCAFile: cfg.CAFile}
		c, err := info.ClientConfig()
		if err != nil {
			return res, fmt.Errorf("etcd TLS: %w", err)
		}
		tlsCfg = c
	}
	cli, err := clientv3.New(clientv3.Config{Endpoints: cfg.Endpoints, DialTimeout: timeout, TLS: tlsCfg, Logger: zap.NewNop()})
	if err != nil {
		return res, fmt.Errorf("etcd at %s: %w", strings.Join(cfg.Endpoints, ","), err)
	}
	defer cli.Close()
	answered := false
	for _, ep := range cfg.Endpoints {
		cctx, cancel := context.WithTimeout(ctx, timeout)
		st, err := cli.Status(cctx, ep)
		cancel()
		es := EndpointStatus{Endpoint: ep, Err: err}
		if err == nil {
			es.Version, answered = st.Version, true
		}
		res.Endpoints = append(res.Endpoints, es)
	}
	if !answered {
		return res, nil
	}
	cctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	r, err := cli.Get(cctx, keys{prefix}.nodes(), clientv3.WithPrefix(), clientv3.WithCountOnly())
	if err == nil {
		res.Nodes = int(r.Count)
	}
	return res, nil
}
