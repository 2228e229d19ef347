package scale

import (
	"maps"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"

	"k8s.io/client-go/rest"
)

// apiProxy stands between the manager and the API server: the manager's kubeconfig points at it
// (plain HTTP on loopback), and it forwards every request with the admin's credentials, counting
// them by verb and resource. So what it counts is exactly the API traffic the manager causes.
type apiProxy struct {
	srv *http.Server
	url string

	mu     sync.Mutex
	counts map[string]int64 // "verb resource[/subresource]"
}

func startAPIProxy(cfg *rest.Config) (*apiProxy, error) {
	target, err := url.Parse(cfg.Host)
	if err != nil {
		return nil, err
	}
	tr, err := rest.TransportFor(cfg)
	if err != nil {
		return nil, err
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	p := &apiProxy{url: "http://" + ln.Addr().String(), counts: map[string]int64{}}
	rp := &httputil.ReverseProxy{
		Rewrite: func(r *httputil.ProxyRequest) {
			r.SetURL(target)
			r.Out.Host = target.Host
		},
		Transport:     tr,
		FlushInterval: -1, // watches stream
	}
	p.srv = &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		p.count(r)
		rp.ServeHTTP(w, r)
	})}
	go func() { _ = p.srv.Serve(ln) }()
	return p, nil
}

func (p *apiProxy) close() { _ = p.srv.Close() }

// kubeconfig writes a kubeconfig for the proxy into dir.
func (p *apiProxy) kubeconfig(dir string) (string, error) {
	path := filepath.Join(dir, "manager.kubeconfig")
	kc := `apiVersion: v1
kind: Config
clusters:
- name: proxy
  cluster: {server: "` + p.url + `"}
users:
- name: manager
  user: {}
contexts:
- name: proxy
  context: {cluster: proxy, user: manager}
current-context: proxy
`
	return path, os.WriteFile(path, []byte(kc), 0o600)
}

func (p *apiProxy) count(r *http.Request) {
	verb, res := classify(r)
	p.mu.Lock()
	p.counts[verb+" "+res]++
	p.mu.Unlock()
}

// classify names a request as kube-apiserver's metrics do: verb (get, list, watch, create,
// update, patch, delete) and resource[/subresource].
func classify(r *http.Request) (verb, resource string) {
	parts := strings.Split(strings.Trim(r.URL.Path, "/"), "/")
	// /api/v1/... or /apis/group/version/...
	switch {
	case len(parts) >= 2 && parts[0] == "api":
		parts = parts[2:]
	case len(parts) >= 3 && parts[0] == "apis":
		parts = parts[3:]
	default:
		return strings.ToLower(r.Method), "nonresource"
	}
	watch := r.URL.Query().Get("watch") == "true" || r.URL.Query().Get("watch") == "1"
	if len(parts) > 0 && parts[0] == "watch" {
		watch, parts = true, parts[1:]
	}
	if len(parts) >= 2 && parts[0] == "namespaces" && len(parts) > 2 {
		parts = parts[2:]
	}
	if len(parts) == 0 {
		return strings.ToLower(r.Method), "nonresource"
	}
	resource = parts[0]
	named := len(parts) >= 2
	if len(parts) >= 3 {
		resource += "/" + parts[2]
	}
	switch r.Method {
	case http.MethodGet:
		switch {
		case watch:
			verb = "watch"
		case named:
			verb = "get"
		default:
			verb = "list"
		}
	case http.MethodPost:
		verb = "create"
	case http.MethodPut:
		verb = "update"
	case http.MethodPatch:
		verb = "patch"
	case http.MethodDelete:
		verb = "delete"
	default:
		verb = strings.ToLower(r.Method)
	}
	return verb, resource
}

func (p *apiProxy) snapshot() map[string]int64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return maps.Clone(p.counts)
}

// apiDelta summarizes the requests between two snapshots.
type apiDelta struct {
	total, writes, statusWrites, events int64
}

func diffAPI(before, after map[string]int64) apiDelta {
	var d apiDelta
	for k, v := range after {
		n := v - before[k]
		if n == 0 {
			continue
		}
		verb, res, _ := strings.Cut(k, " ")
		d.total += n
		switch verb {
		case "create", "update", "patch", "delete":
			d.writes += n
			if res == "downstreamquotas/status" {
				d.statusWrites += n
			}
			if res == "events" {
				d.events += n
			}
		}
	}
	return d
}
